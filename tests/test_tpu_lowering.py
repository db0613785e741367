"""The pipeline lowers for a TPU with the Pallas (Mosaic) kernels, checked on the CPU: the FP4
rollout, the guided GRPO step, and both on a (data, expert) mesh.

`kernels_pallas.common.lowering_for("tpu")` builds the kernels for a TPU and
`lower(lowering_platforms=("tpu",))` runs Mosaic's own passes, so each program is the one a TPU
would compile (nothing runs). A Mosaic kernel is a `tpu_custom_call` that carries its
`kernel_name`: the fused quantize "fp4_quantize_mosaic", the FP4 MoE matmul
"fp4_moe_matmul_mosaic", the FP4 decode attention "fp4_decode_attn_mosaic", the prefill flash
attention "prefill_attention_mosaic"; megablox's `gmm`
names its kernel "kernel", inside the function of its jit, `gmm`.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import common
from kernels_pallas.fp4_quantize import (
    fp4_quantize_with_implementation,
    quantize_capture_reference,
)
from tests import tiny
from trace_jax import fp4
from trace_jax.models import init_model
from trace_jax.rl.config import GRPOConfig, make_optimizer
from trace_jax.rl.methods import get_method
from trace_jax.rl.sharding import (
    batch_spec,
    make_mesh,
    mesh_context,
    shard_batch,
    shard_model,
    shard_optimizer,
)
from trace_jax.rl.step import grpo_step
from trace_jax.rollout import SamplingConfig, generate

# The tiny model at the Mosaic kernels' smallest tiles: head_dim 128 and 128-lane rows for the
# decode attention and the quantize; N and K multiples of 128 and 256 for the FP4 MoE matmul. At
# tiny's 64 every op would step aside to its XLA reference. "auto": megablox on a TPU.
CFG = tiny.model_config(d_model=256, d_ff_expert=256, head_dim=128, grouped_matmul="auto")
SETUP = get_method("trace").setup("nvfp4", CFG.n_layers)  # guidance captured, guided trainer
GRPO = GRPOConfig(group_size=2)
BATCH, PROMPT_LEN = 4, 8
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0, stop_tokens=(1,), pad_id=0)
ROLLOUT_KERNELS = {"fp4_quantize_mosaic", "fp4_moe_matmul_mosaic", "fp4_decode_attn_mosaic"}
MEGABLOX = {"kernel": {"gmm"}}
# One worker runs the module: its tests share the lowered rollout and the mesh.
pytestmark = pytest.mark.xdist_group("tpu_lowering")


def mosaic_kernels(text: str) -> dict[str, set[str]]:
    """kernel_name -> names of the functions of the lowered module `text` that call it."""
    kernels, function = collections.defaultdict(set), None
    for line in text.splitlines():
        if m := re.match(r"\s*func\.func (?:private |public )?@([\w.$-]+)", line):
            function = re.sub(r"_\d+$", "", m.group(1))  # jax numbers a function's copies
        if "@tpu_custom_call" in line:
            kernels[re.search(r'kernel_name = "([^"]*)"', line).group(1)].add(function)
    return dict(kernels)


def _prompts():
    prompts = jnp.ones((BATCH, PROMPT_LEN), jnp.int32)
    return prompts, jnp.asarray([5, 8, 3, 6], jnp.int32)


def _lower_rollout(model, prompts, lengths):
    """(the traced `generate`, its lowered text): the FP4 rollout with the Pallas kernels."""
    graphdef, params = nnx.split(model)
    with common.lowering_for("tpu"):
        traced = generate.trace(
            graphdef,
            params,
            prompts,
            lengths,
            jax.random.key(0),
            sampling=SAMPLING,
            qcfg=SETUP.rollout_qcfg,
            mode=SETUP.rollout_mode,
            capture=SETUP.capture,
            capture_mode=SETUP.capture_mode,
            implementation="pallas",
        )
        return traced, traced.lower(lowering_platforms=("tpu",)).as_text()


def _lower_grpo_step(model, rollout, advantages, logp_old, mesh=None) -> str:
    """The lowered text of the method's GRPO step on `rollout` (abstract); the optimizer state
    placed like `model` on `mesh` if given."""
    optimizer = nnx.Optimizer(model, make_optimizer(GRPO), wrt=nnx.Param)
    if mesh is not None:
        shard_optimizer(optimizer, model, mesh)
    kw = dict(setup=SETUP, grpo=GRPO, temperature=1.0)
    with common.lowering_for("tpu"):
        traced = grpo_step.trace(model, optimizer, rollout, advantages, logp_old, **kw)
        return traced.lower(lowering_platforms=("tpu",)).as_text()


def _step_inputs(rollout_info, sharding=None):
    """Abstract (rollout, advantages, old log-probs) of a rollout's shapes; batch-leading arrays
    placed by `sharding`, the rest replicated on its mesh (as `shard_batch` places them)."""

    def like(shape, dtype):
        if sharding is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        lead = len(shape) >= 1 and shape[0] == BATCH
        where = sharding if lead else NamedSharding(sharding.mesh, P())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

    rollout = jax.tree.map(lambda a: like(a.shape, a.dtype), rollout_info)
    slots = rollout_info.tokens.shape[1]
    return rollout, like((BATCH,), jnp.float32), like((BATCH, slots), jnp.float32)


@pytest.fixture(scope="module")
def rollout():
    """(traced, lowered text) of the FP4 rollout on one device."""
    return _lower_rollout(init_model(CFG, seed=0), *_prompts())


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py)")
    return make_mesh(2, 2)  # data 2 x expert 2


def test_fp4_rollout_lowers_with_every_mosaic_kernel(rollout):
    """Prefill + decode loop with NVFP4 W/A/KV over the packed FP4 cache, guidance captured:
    activation and KV sites quantize by the fused kernel, the experts run the FP4 MoE matmul on
    the packed weights (no `ragged_dot` left), decode steps attend by the FP4 decode attention."""
    traced, text = rollout
    assert set(mosaic_kernels(text)) == ROLLOUT_KERNELS
    assert "ragged_dot" not in text and "gpu.triton" not in text
    assert set(traced.out_info.guidance) == set(SETUP.capture)


def test_prefill_chunks_attend_by_the_mosaic_flash_kernel(mesh):
    """With `prefill_attention="auto"` the rollout's prefill chunks attend by the Mosaic flash
    kernel beside the other rollout kernels (decode steps keep the FP4 decode attention), on one
    device and on a data x expert mesh (in a shard_map: each device attends its own rows)."""
    model = init_model(dataclasses.replace(CFG, prefill_attention="auto"), seed=0)
    _, text = _lower_rollout(model, *_prompts())
    assert set(mosaic_kernels(text)) == ROLLOUT_KERNELS | {"prefill_attention_mosaic"}
    shard_model(model, mesh)
    with mesh_context(mesh):
        _, text = _lower_rollout(model, *shard_batch(_prompts(), mesh, BATCH))
    assert "sdy.manual_computation" in text
    assert set(mosaic_kernels(text)) == ROLLOUT_KERNELS | {"prefill_attention_mosaic"}


def test_guided_train_step_lowers_with_megablox_only(rollout):
    """The guided GRPO step (fake quantization with the rollout's guidance) keeps the XLA
    quantizer by design; its bf16 routed experts ("auto") run megablox's Mosaic `gmm` forward."""
    rollout_info = rollout[0].out_info
    text = _lower_grpo_step(init_model(CFG, seed=0), *_step_inputs(rollout_info))
    assert mosaic_kernels(text) == MEGABLOX
    assert "ragged_dot" not in text and "gpu.triton" not in text


def test_rollout_and_grpo_step_lower_on_a_data_by_expert_mesh(rollout, mesh):
    """On a mesh GSPMD cannot partition a Mosaic call: each runs in a shard_map
    (`common.per_device`), or the lowering raises "Mosaic kernels cannot be automatically
    partitioned". Placement as the RL workers do it: parameters by `shard_model`, rows over
    "data"."""
    model = init_model(CFG, seed=0)
    shard_model(model, mesh)
    prompts, lengths = shard_batch(_prompts(), mesh, BATCH)
    rows = NamedSharding(mesh, batch_spec(mesh))
    with mesh_context(mesh):
        _, rollout_text = _lower_rollout(model, prompts, lengths)
        step_text = _lower_grpo_step(model, *_step_inputs(rollout[0].out_info, rows), mesh)
    for text in (rollout_text, step_text):
        assert "mhlo.num_partitions = 4" in text and "sdy.manual_computation" in text
    assert set(mosaic_kernels(rollout_text)) == ROLLOUT_KERNELS
    assert mosaic_kernels(step_text) == MEGABLOX


def test_per_device_splits_independent_rows_over_the_mesh(mesh):
    """The Mosaic quantize in the TPU interpreter on a mesh: x [8, 3, 128] split along its first
    axis over data x expert (2 x 3 rows a device), bit for bit the one-device reference."""
    x = jax.random.normal(jax.random.key(1), (8, 3, 128), jnp.float32).astype(jnp.bfloat16)
    params = pltpu.InterpretParams()
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        out, ran = fp4_quantize_with_implementation(
            xs, fp4.NVFP4, implementation="pallas", interpret=params
        )
        with pytest.raises(ValueError, match=r"one leading axis size, got sizes \{8, 3\}"):
            common.per_device(lambda a, b: a, x, x[:3], split_leading=True)
    assert ran == "pallas"
    assert out.packed_codes.sharding.spec == P(("data", "expert"))
    want = quantize_capture_reference(x, fp4.NVFP4)
    for got, ref in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
