"""The rollout's MoE on a data-parallel mesh: each device routes, multiplies and combines its own
rows (`trace_jax.models.moe.rows_per_device`, `ModelConfig.moe_routing_per_device`).

On a 2-device CPU mesh (rows split over "data", parameters replicated, as the RL workers place
them) the sharded rollout equals the unsharded one bit for bit, tokens, log-probs, expert
choices and captured guidance (the "expert_mid" captures leave the shard_map by rows), in bf16
and in FP4 on the Pallas kernels (interpreted); its compiled program has no collective in any
block's MoE, where GSPMD's routing of all rows together has several a layer. The trainer's
forward (no cache) keeps GSPMD's routing. Collectives are read from the compiled HLO text
(`trace_jax.rollout.collectives`, itself checked on hand-written HLO lines).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from trace_jax.models import forward_jit, init_model
from trace_jax.models.moe import data_parallel_mesh
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rl.sharding import make_mesh, shard_batch, shard_model
from trace_jax.rollout import SamplingConfig, generate
from trace_jax.rollout.collectives import Collective, collective_counts, hlo_collectives

pytestmark = [
    pytest.mark.usefixtures("pallas_interpreted_on_cpu"),
    pytest.mark.xdist_group("moe_per_device"),
]

CFG = tiny.model_config()  # bf16 compute, 2 blocks
QCFG = QuantConfig.nvfp4()
SAMPLING = SamplingConfig(max_new_tokens=4, temperature=1.0, stop_tokens=(1,), pad_id=0)
PROMPTS = jnp.array(
    [[3, 5, 7, 9, 11, 0], [2, 4, 6, 8, 10, 12], [1, 1, 0, 0, 0, 0], [4, 4, 4, 2, 0, 0]], jnp.int32
)
LENGTHS = jnp.array([5, 6, 2, 4], jnp.int32)
# The blocks of each variant's model: bf16 checks every block's MoE of the 2-block model; the
# FP4 one (Pallas kernels, captures) runs one block, whose MoE is every block's code, at about 60%
# of the compile time.
N_LAYERS = {"bf16": CFG.n_layers, "fp4": 1}
VARIANTS = {
    "bf16": dict(qcfg=QCFG, mode=SiteMode.OFF, implementation="xla"),
    "fp4": dict(
        qcfg=QCFG,
        mode=SiteMode.RTN,
        capture=QCFG.all_keys(N_LAYERS["fp4"]),
        implementation="pallas",
    ),
}


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py)")
    return make_mesh(2)  # data 2 (fsdp, expert 1): the data-parallel rollout's mesh


def _model(per_device: bool, n_layers: int = CFG.n_layers):
    cfg = dataclasses.replace(CFG, moe_routing_per_device=per_device, n_layers=n_layers)
    return init_model(cfg, seed=1)


def _unsharded(variant: str):
    gd, params = nnx.split(_model(True, N_LAYERS[variant]))
    return generate(gd, params, PROMPTS, LENGTHS, jax.random.key(0), sampling=SAMPLING,
                    **VARIANTS[variant])  # fmt: skip


def _sharded(mesh, variant: str, per_device: bool):
    """(the rollout on the mesh, its compiled program's collectives)."""
    model = _model(per_device, N_LAYERS[variant])
    shard_model(model, mesh)
    kw = dict(sampling=SAMPLING, **VARIANTS[variant])
    with jax.set_mesh(mesh):
        prompts, lengths = shard_batch((PROMPTS, LENGTHS), mesh, PROMPTS.shape[0])
        gd, params = nnx.split(model)
        args = (gd, params, prompts, lengths, jax.random.key(0))
        text = generate.lower(*args, **kw).compile().as_text()
        return generate(*args, **kw), hlo_collectives(text)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sharded_rollout_routes_per_device_bit_for_bit(mesh, variant):
    want = _unsharded(variant)
    got, found = _sharded(mesh, variant, per_device=True)
    leaves = jax.tree_util.tree_leaves_with_path(got)
    assert len(leaves) == len(jax.tree.leaves(want))
    for (path, g), w in zip(leaves, jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, path
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(path))
    if variant == "fp4":  # the captures written inside the shard_map came out
        assert any(k.endswith("expert_mid") for k in got.guidance)
    in_moe = [c for c in found if c.layer_part is not None and c.layer_part[1] == "moe"]
    assert not in_moe, f"the MoE moves rows between devices: {in_moe}"
    counts = collective_counts(found, N_LAYERS[variant])
    # What is left of a decode step: the loop's every-row-finished test.
    assert counts["decode_step"] == counts["decode_other"] == 1, counts


def test_gspmd_routing_gathers_every_layer(mesh):
    """The earlier path (`moe_routing_per_device=False`): GSPMD routes both devices' rows
    together, with collectives in every block's MoE of every decode step and of the prefill."""
    _, found = _sharded(mesh, "bf16", per_device=False)
    moe_layers = {c.layer_part[0] for c in found if c.layer_part and c.layer_part[1] == "moe"}
    assert moe_layers == set(range(CFG.n_layers))
    counts = collective_counts(found, CFG.n_layers)
    assert counts["decode_moe"] >= CFG.n_layers and counts["prefill_moe"] >= CFG.n_layers


def test_trainer_forward_keeps_gspmd_routing(mesh):
    """The uncached forward (the trainer's) routes all rows together even with the flag on: a
    per-device routing would change the weight gradients' summation order."""
    model = _model(True)
    shard_model(model, mesh)
    tokens = jnp.tile(PROMPTS, (2, 1))
    with jax.set_mesh(mesh):
        (tokens,) = shard_batch((tokens,), mesh, tokens.shape[0])
        gd, params = nnx.split(model)
        text = forward_jit.lower(gd, params, tokens).compile().as_text()
    assert any(c.layer_part and c.layer_part[1] == "moe" for c in hlo_collectives(text))


def test_data_parallel_mesh_only_for_rows_over_data_alone():
    """Per-device routing needs the rows split over "data" alone with weights replicated: no
    mesh, an expert or fsdp axis, or rows the data axis does not divide keep GSPMD."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py)")
    assert data_parallel_mesh(4) is None  # no mesh
    cases = [
        (make_mesh(2), 4, True),
        (make_mesh(2), 3, False),
        (make_mesh(1), 4, False),
        (make_mesh(1, 2), 4, False),
        (make_mesh(1, fsdp=2), 4, False),
        (make_mesh(2, 2), 4, False),
    ]
    for mesh, rows, per_device in cases:
        with jax.set_mesh(mesh):
            assert (data_parallel_mesh(rows) is not None) == per_device, (mesh.shape, rows)


def test_hlo_collectives_reads_instructions_and_scopes():
    """Hand-written compiled-HLO lines: collectives (an async pair once, a tuple shape) with
    their op names and regions; names and operands that only mention a collective are not."""
    text = "\n".join(
        [
            "  %all-gather.1 = f32[4,8]{1,0} all-gather(%p), dimensions={0}, metadata={op_name="
            '"jit(generate)/decode_loop/while/body/layer_1/moe/div"}',
            "  %ars = (f32[2]{0}, f32[2]{0}) all-reduce-start(%a, %b), to_apply=%add, metadata={"
            'op_name="jit(generate)/prefill/while/body/layer_0/attention/dot"}',
            "  %ard = (f32[2]{0}, f32[2]{0}) all-reduce-done(%ars)",
            '  %all-reduce.7 = pred[] all-reduce(%r), metadata={op_name="jit(generate)/'
            'decode_loop/while/cond/reduce_and"}',
            "  %cp = u8[3]{0} collective-permute(%x), source_target_pairs={{0,1}}",
            "  %add.3 = f32[] add(%all-gather.1, %all-reduce.7)",
        ]
    )
    found = hlo_collectives(text)
    assert [c.op for c in found] == ["all-gather", "all-reduce", "all-reduce", "collective-permute"]
    assert [c.region for c in found] == ["decode", "prefill", "decode", "other"]
    assert [c.layer_part for c in found] == [(1, "moe"), (0, "attention"), None, None]
    counts = collective_counts(found, n_layers=2)
    assert counts == {
        "decode_step": 2,
        "decode_moe": 1,
        "decode_attention": 0,
        "decode_other": 1,
        "decode_moe_per_layer": 0.5,
        "decode_ops": "all-gather 1, all-reduce 1",
        "prefill": 1,
        "prefill_moe": 0,
        "other": 1,
    }
    assert Collective("all-to-all", "").region == "other"
