"""The guided-layer study: its layer sets, one rollout scored per set, and trained policies
(checkpoints) studied on task prompts."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import guided_layer_study as study_configs
from configs import train_rollout_gap
from tests import tiny
from trace_jax import tasks
from trace_jax.models import init_model
from trace_jax.quant import quant_recipe
from trace_jax.rl.checkpoint import checkpoint_manager, save_params, save_train_state
from trace_jax.rl.config import make_optimizer
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables import layer_study
from trace_jax.tables.gap import GapConfig, sample_pair
from trace_jax.tables.layer_study import (
    BF16_PAIR,
    RANDOM_INIT,
    guided_layer_study,
    layer_sets,
    load_trained_policy,
    score_layer_sets,
)


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


# 2 rows of up to 16 prompt tokens (countdown prompts have 14-16) and 4 new tokens: every test
# here (and `test_gap.py`'s, in the same xdist group) scores these shapes, so the compiled
# rollouts and training forwards are shared.
GAP = GapConfig(batch=2, prompt_len=16)
pytestmark = pytest.mark.xdist_group("gap_shapes")


@pytest.fixture(scope="module")
def scored():
    """Rows and per-layer mismatch of a 2-block model's rollout, scored by a perturbed trainer
    (the same policy gives no code flip at this size on the CPU) with three layer sets."""
    cd = train_rollout_gap.get_config()
    cd.model.n_layers = tiny.N_LAYERS
    cd.rl.max_new_tokens = 4
    config = ExperimentConfig.from_config_dict(cd)
    pair = sample_pair(config, GAP, quant_recipe("nvfp4"))  # shapes the trained study's share
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


def study_config(**model) -> ExperimentConfig:
    cd = study_configs.get_config()
    cd.model.update({"n_layers": tiny.N_LAYERS, **model})
    cd.tasks.kinds = ("countdown",)
    cd.rl.update(max_new_tokens=4, steps=2)
    return ExperimentConfig.from_config_dict(cd)


def params_of(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A policy unlike the study's random init (another seed), saved as parameters."""
    config = study_config()
    model = init_model(config.model, seed=config.seed + 7)
    path = str(tmp_path_factory.mktemp("trained") / "params")
    save_params(model, path)
    return config, model, path


def test_study_samples_task_prompts_with_the_checkpoint(trained, monkeypatch):
    config, model, path = trained
    pairs = []  # (config, pair) of every policy the study samples
    # The sets `scored` compiled (the shallower half and odd layers add nothing tested here).
    sets = {"none (rtn)": (), "deeper half": (1,), "all layers": (0, 1)}
    monkeypatch.setattr(layer_study, "layer_sets", lambda n_layers: sets)

    def recording_sample_pair(cfg, gap, qcfg, model=None):
        pair = sample_pair(cfg, gap, qcfg, model)
        pairs.append((cfg, pair))
        return pair

    monkeypatch.setattr(layer_study, "sample_pair", recording_sample_pair)
    result = guided_layer_study(config, GAP, checkpoints=[("trained", path)])

    assert [(p["policy"], p["n_layers"]) for p in result.policies] == [
        (RANDOM_INIT, tiny.N_LAYERS),
        ("trained", tiny.N_LAYERS),
    ]
    assert "task prompts" in result.policies[1]["sampled"] and path in result.policies[1]["sampled"]
    for label in (RANDOM_INIT, "trained"):
        assert [r["layer_set"] for r in result.rows if r["policy"] == label] == [BF16_PAIR, *sets]
    assert {r["policy"] for r in result.per_layer} == {RANDOM_INIT, "trained"}

    (random_cfg, random_pair), (trained_cfg, trained_pair) = pairs
    # The trained rollout ran the saved weights, not the config's random init.
    for got, want in zip(params_of(trained_pair.model), params_of(model), strict=True):
        np.testing.assert_array_equal(got, want)
    init = params_of(random_pair.model)
    assert not all(map(np.array_equal, params_of(trained_pair.model), init))
    # ... on the first training problems of `tasks`, encoded as the rollout's prompts.
    stream = tasks.train_stream(config.seed, tasks=("countdown",), levels=config.tasks.levels)
    problems = itertools.islice(stream, GAP.batch)
    prompts, lengths = tasks.encode_prompts(list(problems), pad_to=GAP.prompt_len)
    roll = trained_pair.fp4
    np.testing.assert_array_equal(np.asarray(roll.prompt_lengths), lengths)
    for row, n in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(roll.tokens)[row, :n], prompts[row, :n])
    assert trained_cfg.rl.init_from == path and not random_cfg.rl.init_from
    # The random policy's prompts are random tokens, not the task's.
    assert not np.array_equal(np.asarray(random_pair.fp4.tokens)[:, : lengths.min()], prompts)


def test_a_checkpoint_that_does_not_fit_is_refused_before_sampling(trained, tmp_path, monkeypatch):
    config, _, path = trained
    with pytest.raises(FileNotFoundError, match="no saved parameters"):
        guided_layer_study(config, GAP, checkpoints=[("x", str(tmp_path / "missing"))])
    monkeypatch.chdir(os.path.dirname(path))  # a path relative to the working directory
    relative = [("x", os.path.basename(path))]
    with pytest.raises(ValueError, match=r"has 2 decoder blocks.*model.n_layers=3"):
        guided_layer_study(study_config(n_layers=3), GAP, checkpoints=relative)
    with pytest.raises(ValueError, match=r"k_norm.scale is \(16,\) there, \(32,\) in the model"):
        guided_layer_study(study_config(head_dim=32), GAP, checkpoints=[("x", path)])
    with pytest.raises(ValueError, match=r"leave rl\.init_from empty"):
        rl = dataclasses.replace(config.rl, init_from=path)
        guided_layer_study(dataclasses.replace(config, rl=rl), GAP)
    with pytest.raises(ValueError, match="distinct"):
        guided_layer_study(config, GAP, checkpoints=[("x", path), ("x", path)])


def test_an_rl_run_is_loaded_at_its_final_step(trained, tmp_path):
    config, model, _ = trained
    grpo = config.rl.grpo  # the RL trainer's optimizer (`Trainer`), at the run's final step
    total = config.rl.steps * grpo.mini_batches
    optimizer = nnx.Optimizer(model, make_optimizer(grpo, total), wrt=nnx.Param)
    manager = checkpoint_manager(str(tmp_path / "rl_checkpoints"), 1)
    save_train_state(manager, config.rl.steps - 1, model, optimizer, force=True)
    manager.wait_until_finished()
    manager.close()
    for got, want in zip(
        params_of(load_trained_policy(config, str(tmp_path))), params_of(model), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    longer = dataclasses.replace(config, rl=dataclasses.replace(config.rl, steps=5))
    with pytest.raises(ValueError, match="newest checkpoint is step 1, not the final step"):
        guided_layer_study(longer, GAP, checkpoints=[("rl", str(tmp_path))])
    assert os.listdir(tmp_path / "rl_checkpoints") == ["1"]  # refused, not set aside as corrupt
