"""Placement on a (data, fsdp, expert) mesh of host devices, and a GRPO step on it that equals
the unsharded step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests import tiny
from tests.rl.rollouts import task_rollout
from trace_jax.models import init_model
from trace_jax.rl.advantages import grpo_advantages
from trace_jax.rl.config import GRPOConfig
from trace_jax.rl.methods import get_method
from trace_jax.rl.sharding import (
    abstract_mesh,
    make_mesh,
    param_sharding_rule,
    param_spec,
    place_state,
    shard_batch,
    shard_model,
    shard_optimizer,
    state_shardings,
)
from trace_jax.rl.step import grpo_step, old_logprobs

CFG = tiny.model_config(dtype=jnp.float32)
# The step's model: one block holds every kind of parameter the placement splits (embedding,
# attention, router, experts, norms, head), and a block less is about 40% less to compile.
STEP_CFG = tiny.model_config(dtype=jnp.float32, n_layers=1)
GRPO = GRPOConfig(group_size=2, learning_rate=1e-3)
SGD_LR = 0.1
needs_8_devices = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)"
)

# float32 tolerances, from the reduction order the sharding changes. Reordering a float32 sum of
# n terms moves it by at most about n * u * sum|terms| (u = 2**-24). The longest reduction of the
# step has n <= 128 (B * S = 8 * 13 token positions; D = F = 64 features), and a gradient passes
# through at most about 8 of them (2 blocks, forward and backward; the step's model has one):
# 8 * 128 * u = 6e-5 of a leaf's scale, rounded up to GRAD_RTOL (measured on one CPU: under
# 1e-6). FSDP only regroups the same sums (partial sums over a split feature or row axis, then a
# cross-device add), so the bound holds for it too. The loss is a mean of terms of size about 1
# (advantage times ratio), so its noise is absolute: 128 * u = 8e-6, up to LOSS_ATOL.
GRAD_RTOL = 1e-4
LOSS_ATOL = 1e-5

# The tiny model's parameters on a 2 x 2 x 2 (data, fsdp, expert) mesh, by hand from the rule:
# E over "expert" for routed experts, then the largest dim fsdp divides (the first on a tie) over
# "fsdp" for matrices; vectors replicated. V = D = F = 64, H = 4, Hkv = 2, Dh = 16, E = 8.
FSDP_SPECS = {
    "embed": P("fsdp"),  # [V, D]: a tie, the first
    "lm_head": P("fsdp"),  # [D, V]
    "final_norm.scale": P(),
    "layers.0.attn.w_q": P("fsdp"),  # [D, H, Dh]
    "layers.0.attn.w_k": P("fsdp"),  # [D, Hkv, Dh]
    "layers.0.attn.w_o": P(None, None, "fsdp"),  # [H, Dh, D]
    "layers.0.attn.q_norm.scale": P(),
    "layers.1.attn_norm.scale": P(),
    "layers.1.moe.router": P("fsdp"),  # [D, E]
    "layers.1.moe.w_gate": P("expert", "fsdp"),  # [E, F, D]
    "layers.1.moe.w_down": P("expert", "fsdp"),  # [E, D, F]
}


def _specs(state) -> dict[str, P]:
    """Dotted parameter path -> PartitionSpec of each leaf of an nnx state."""
    flat = jax.tree_util.tree_leaves_with_path(state)
    names = [".".join(str(getattr(k, "key", k)) for k in p[:-1]) for p, _ in flat]
    return {n: x.sharding.spec for n, (_, x) in zip(names, flat, strict=True)}


def test_param_spec_rule_on_shapes():
    """The rule alone: largest divisible free dim; E over expert only where it divides; size-1
    axes dropped; on an abstract mesh larger than the machine."""
    sizes = {"data": 2, "fsdp": 4, "expert": 4}
    assert param_spec("a.w", (6, 4), sizes) == P(None, "fsdp")  # 6 % 4: the next largest
    assert param_spec("a.w", (6, 3), sizes) == P()  # no dim divisible: replicated
    assert param_spec("a.scale", (64,), sizes) == P()  # vectors stay whole
    assert param_spec("moe.w_up", (8, 4, 16), sizes) == P("expert", None, "fsdp")
    assert param_spec("moe.w_up", (6, 4, 16), sizes) == P(None, None, "fsdp")  # 6 % 4 experts
    assert param_spec("shared.w_up", (64, 16), sizes) == P("fsdp")  # 2-D: not routed experts
    no_fsdp = {"data": 8, "fsdp": 1, "expert": 8}  # the plain (data, expert) placement
    assert param_spec("moe.w_down", (128, 2048, 768), no_fsdp) == P("expert")
    assert param_spec("embed", (151936, 2048), no_fsdp) == P()
    mesh = abstract_mesh(8, 8, fsdp=8)  # 512 devices, none of them here
    rule = param_sharding_rule(mesh)
    w = rule("layers.3.moe.w_gate", jax.ShapeDtypeStruct((128, 768, 2048), jnp.float32))
    assert w.spec == P("expert", None, "fsdp") and w.shard_shape((128, 768, 2048)) == (16, 768, 256)
    # State follows the parameter whose path ends its own and whose shape it has; else whole.
    params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    like = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    state = {"mu": {"w": like(8, 4)}, "v_row": {"w": like(8)}, "other": like(8, 4), "n": like()}
    got = jax.tree.map(lambda s: s.spec, state_shardings(state, abstract_mesh(1, fsdp=4), params))
    assert got == {"mu": {"w": P("fsdp")}, "v_row": {"w": P()}, "other": P(), "n": P()}
    with pytest.raises(ValueError, match=r"ints >= 1, got \{'fsdp': 0\}"):
        abstract_mesh(2, 2, fsdp=0)


@needs_8_devices
def test_placement_of_each_kind_of_leaf_on_a_2x2x2_mesh():
    mesh = make_mesh(2, 2, fsdp=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2}
    model, opt = _build()
    shard_model(model, mesh)
    shard_optimizer(opt, model, mesh)
    params = _specs(nnx.state(model))
    assert {k: params[k] for k in FSDP_SPECS} == FSDP_SPECS
    w_gate = model.layers[1].moe.w_gate[...]
    assert {s.data.shape for s in w_gate.addressable_shards} == {(4, 32, 64)}
    assert len({s.index for s in w_gate.addressable_shards}) == 4  # 2 data replicas of each
    # The checkpoint loader's rule (dotted paths) places every parameter as the model is.
    rule = param_sharding_rule(mesh)
    for name, x in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        dotted = ".".join(str(getattr(k, "key", k)) for k in name[:-1])
        assert rule(dotted, x).spec == x.sharding.spec, dotted
    # Optimizer state: SGD's momentum follows its parameter; scalar counters replicated.
    moments = {k.split("trace.")[1]: v for k, v in _specs(nnx.state(opt)).items() if "trace." in k}
    assert moments == params
    others = [v for k, v in _specs(nnx.state(opt)).items() if "trace." not in k]
    assert others and all(v == P() for v in others)
    _, opt2 = _build()
    place_state(opt2, mesh)  # without the model: the rule on each leaf's own path and shape
    assert _specs(nnx.state(opt2)) == _specs(nnx.state(opt))
    # The batch splits over data x fsdp; other arrays are replicated.
    rows, scalar = shard_batch((jnp.zeros((8, 3)), jnp.zeros((3,))), mesh, batch_size=8)
    assert rows.sharding.spec == P(("data", "fsdp")) and scalar.sharding.spec == P()
    assert {s.data.shape for s in rows.addressable_shards} == {(2, 3)}
    with pytest.raises(ValueError, match=r"6 is not divisible by 4 batch shards"):
        shard_batch(jnp.zeros((6, 3)), mesh, batch_size=6)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(8, 2)


def _build(cfg=CFG):
    model = init_model(cfg, seed=1)
    # SGD with momentum: its first step is linear in the gradient, and its momentum then holds the
    # (clipped) gradient itself (see the test's docstring for why not AdamW).
    sgd = optax.chain(
        optax.clip_by_global_norm(GRPO.grad_clip_norm), optax.sgd(SGD_LR, momentum=0.9)
    )
    return model, nnx.Optimizer(model, sgd, wrt=nnx.Param)


def _gradients(optimizer: nnx.Optimizer) -> list[np.ndarray]:
    """The clipped gradient of the first step: SGD's momentum after it, per parameter leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(optimizer))
    return [np.asarray(x) for p, x in leaves if "'trace'" in jax.tree_util.keystr(p)]


@pytest.fixture(scope="module")
def unsharded():
    """The rollout batch, and the loss, metrics, gradients and parameters of the unsharded step
    on it (with the parameters before it)."""
    setup = get_method("trace_full").setup("nvfp4", STEP_CFG.n_layers)
    model, opt = _build(STEP_CFG)
    roll = task_rollout(model, setup, n_problems=4, group_size=2)
    adv = grpo_advantages(jnp.asarray([1.0, 0, 0, 1, 1, 0, 0, 1]), 2)
    lp = old_logprobs(model, roll, setup=setup, grpo=GRPO, temperature=1.0)
    kw = dict(setup=setup, grpo=GRPO, temperature=1.0)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    metrics = grpo_step(model, opt, roll, adv, lp, **kw)
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    return dict(batch=(roll, adv, lp), kw=kw, metrics=metrics, grads=_gradients(opt),
                before=before, after=after)  # fmt: skip


@needs_8_devices
@pytest.mark.parametrize("data,fsdp,expert", [(4, 1, 2), (2, 2, 2)])
def test_sharded_step_equals_unsharded(unsharded, data, fsdp, expert):
    """Loss, metrics, gradients and updated parameters of the sharded step match the unsharded.

    Sharding reorders float32 reductions, so gradients match to `GRAD_RTOL` of each leaf's scale
    (module constants), far below the O(1) errors of a missing reduction or misplaced rows. The
    parameters are compared after an SGD step, which moves them by `SGD_LR * g`: a gradient
    difference maps to `SGD_LR` times itself, plus an ulp of rounding. Not after an AdamW step:
    its first step moves each parameter by `lr * g / (|g| + eps)`, about `lr * sign(g)`, so
    reduction noise on a gradient near zero (|g| ~ eps) becomes a move of up to `lr`.

    The method is `trace_full`: the trainer's FP4 rounding of activations follows the rollout's
    full codes and scales at every site (and the weights, the same in both, round the same), so
    ulp-level differences in activations cannot flip a rounding decision (an RTN site could,
    turning reduction noise into a whole FP4 step).
    """
    mesh = make_mesh(data, expert, fsdp=fsdp)
    model, opt = _build(STEP_CFG)
    shard_model(model, mesh)
    shard_optimizer(opt, model, mesh)
    placed = _specs(nnx.state(model))
    batch = shard_batch(unsharded["batch"], mesh, batch_size=8)
    with jax.set_mesh(mesh):
        got = grpo_step(model, opt, *batch, **unsharded["kw"])

    ref = unsharded["metrics"]
    assert sorted(got) == sorted(ref)
    for name in ref:
        want, have = np.asarray(ref[name]), np.asarray(got[name])
        np.testing.assert_allclose(have, want, rtol=GRAD_RTOL, atol=LOSS_ATOL, err_msg=name)
    b = jax.tree.leaves(nnx.state(model, nnx.Param))
    leaves = zip(unsharded["grads"], _gradients(opt), unsharded["before"], unsharded["after"], b,
                 strict=True)  # fmt: skip
    for g_ref, g, p0, p_ref, p in leaves:
        scale = np.max(np.abs(g_ref))
        assert scale > 0  # every parameter gets a gradient
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=GRAD_RTOL * scale)
        p = np.asarray(p)
        ulp = np.spacing(np.maximum(np.abs(p_ref), np.abs(p)))
        # The momentum is the gradient the step applied (to the rounding of p - lr * g)...
        np.testing.assert_array_less(np.abs(p_ref - (p0 - SGD_LR * g_ref)), ulp * 1.01)
        # ...so the sharded parameters are off by at most lr times the gradient tolerance.
        np.testing.assert_array_less(np.abs(p - p_ref), SGD_LR * GRAD_RTOL * scale + ulp)
    # The updated parameters keep their placement (an FSDP step must not leave them gathered).
    assert _specs(nnx.state(model)) == placed
    assert placed["layers.0.moe.w_gate"] == (P("expert", "fsdp") if fsdp > 1 else P("expert"))
