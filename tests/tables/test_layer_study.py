"""The guided-layer study: its layer sets, and one rollout scored per set."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import train_rollout_gap
from tests import tiny
from trace_jax.quant import quant_recipe
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables.gap import GapConfig, sample_pair
from trace_jax.tables.layer_study import BF16_PAIR, layer_sets, score_layer_sets


def test_layer_sets_name_their_layers():
    assert layer_sets(8) == {
        "none (rtn)": (),
        "deeper half": (4, 5, 6, 7),
        "shallower half": (0, 1, 2, 3),
        "odd layers": (1, 3, 5, 7),
        "all layers": tuple(range(8)),
    }
    five = layer_sets(5)  # "half" of an odd depth rounds up; the shallower half is the rest
    assert five["deeper half"] == (2, 3, 4) and five["shallower half"] == (0, 1)
    assert five["odd layers"] == (1, 3)


def perturbed(model, rel: float, seed: int = 1):
    """A copy of `model` with every parameter times (1 + rel * N(0, 1)): a newer policy, whose
    trainer codes differ from the rollout's at a measurable fraction of elements."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x * (1 + rel * jax.random.normal(k, x.shape, x.dtype))
        if jnp.issubdtype(x.dtype, jnp.floating)
        else x
        for x, k in zip(leaves, keys, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


@pytest.fixture(scope="module")
def scored():
    """Rows and per-layer mismatch of a 2-block model's rollout, scored by a perturbed trainer
    (the same policy gives no code flip at this size on the CPU) with three layer sets."""
    cd = train_rollout_gap.get_config()
    cd.model.n_layers = tiny.N_LAYERS
    cd.rl.max_new_tokens = 4
    config = ExperimentConfig.from_config_dict(cd)
    pair = sample_pair(config, GapConfig(batch=2, prompt_len=4), quant_recipe("nvfp4"))
    pair = dataclasses.replace(pair, model=perturbed(pair.model, 0.02))
    sets = {"none (rtn)": (), "deeper half": (1,), "all layers": (0, 1)}
    rows, per_layer = score_layer_sets(pair, config, sets)
    by_layer = {(r["layer_set"], r["layer"]): r["code_mismatch"] for r in per_layer}
    return {r["layer_set"]: r for r in rows}, by_layer


def test_bytes_scale_with_the_guided_layers(scored):
    rows, _ = scored
    assert list(rows) == [BF16_PAIR, "none (rtn)", "deeper half", "all layers"]
    assert [rows[s]["guided_layers"] for s in rows] == [[], [], [1], [0, 1]]
    half = rows["deeper half"]["guidance_bytes_per_token"]
    assert rows["none (rtn)"]["guidance_bytes_per_token"] == 0.0 and half > 0
    assert rows["all layers"]["guidance_bytes_per_token"] == 2 * half  # two equal blocks


def test_mismatch_over_guided_and_unguided_sites(scored):
    rows, by_layer = scored
    rtn, half, every = rows["none (rtn)"], rows["deeper half"], rows["all layers"]
    assert rtn["code_mismatch"] > 0.01
    assert math.isnan(rtn["code_mismatch_guided"]) and math.isnan(every["code_mismatch_unguided"])
    assert rtn["code_mismatch_unguided"] == rtn["code_mismatch"]
    # Layers before the first guided one compute exactly what the RTN trainer computes.
    assert by_layer["deeper half", 0] == by_layer["none (rtn)", 0] > 0
    assert by_layer["deeper half", 1] < by_layer["none (rtn)", 1] / 2
    for layer in (0, 1):
        assert by_layer["all layers", layer] < by_layer["none (rtn)", layer] / 2
    # The whole-model mismatch pools both layers' elements.
    assert every["code_mismatch"] < half["code_mismatch"] < rtn["code_mismatch"]
    assert half["code_mismatch_unguided"] == by_layer["deeper half", 0]
    assert every["code_mismatch_guided"] == every["code_mismatch"]
