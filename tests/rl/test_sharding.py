"""A GRPO step on a (data, expert) mesh of 8 host devices equals the unsharded step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests import tiny
from tests.rl.rollouts import task_rollout
from trace_jax.models import init_model
from trace_jax.rl.advantages import grpo_advantages
from trace_jax.rl.config import GRPOConfig
from trace_jax.rl.methods import get_method
from trace_jax.rl.sharding import make_mesh, shard_batch, shard_model, shard_optimizer
from trace_jax.rl.step import grpo_step, old_logprobs

CFG = tiny.model_config(dtype=jnp.float32)
GRPO = GRPOConfig(group_size=2, learning_rate=1e-3)
SGD_LR = 0.1

# float32 tolerances, from the reduction order the sharding changes. Reordering a float32 sum of
# n terms moves it by at most about n * u * sum|terms| (u = 2**-24). The longest reduction of the
# step has n <= 128 (B * S = 8 * 13 token positions; D = F = 64 features), and a gradient passes
# through about 8 of them (2 blocks, forward and backward): 8 * 128 * u = 6e-5 of a leaf's scale,
# rounded up to GRAD_RTOL (measured on one CPU: under 1e-6). The loss is a mean of terms of size
# about 1 (advantage times ratio), so its noise is absolute: 128 * u = 8e-6, up to LOSS_ATOL.
GRAD_RTOL = 1e-4
LOSS_ATOL = 1e-5


def _build():
    model = init_model(CFG, seed=1)
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


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
def test_sharded_step_equals_unsharded():
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
    setup = get_method("trace_full").setup("nvfp4", CFG.n_layers)
    model, opt = _build()
    roll = task_rollout(model, setup, n_problems=4, group_size=2)
    adv = grpo_advantages(jnp.asarray([1.0, 0, 0, 1, 1, 0, 0, 1]), 2)
    lp = old_logprobs(model, roll, setup=setup, grpo=GRPO, temperature=1.0)
    kw = dict(setup=setup, grpo=GRPO, temperature=1.0)
    params_before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    ref = grpo_step(model, opt, roll, adv, lp, **kw)

    mesh = make_mesh(4, 2)
    model2, opt2 = _build()
    shard_model(model2, mesh)
    shard_optimizer(opt2, model2, mesh)
    roll2, adv2, lp2 = shard_batch((roll, adv, lp), mesh, batch_size=8)
    with jax.set_mesh(mesh):
        got = grpo_step(model2, opt2, roll2, adv2, lp2, **kw)

    assert sorted(got) == sorted(ref)
    for name in ref:
        want, have = np.asarray(ref[name]), np.asarray(got[name])
        np.testing.assert_allclose(have, want, rtol=GRAD_RTOL, atol=LOSS_ATOL, err_msg=name)
    grads_ref, grads = _gradients(opt), _gradients(opt2)
    a = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    b = jax.tree.leaves(nnx.state(model2, nnx.Param))
    for g_ref, g, p0, p_ref, p in zip(grads_ref, grads, params_before, a, b, strict=True):
        scale = np.max(np.abs(g_ref))
        assert scale > 0  # every parameter gets a gradient
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=GRAD_RTOL * scale)
        p = np.asarray(p)
        ulp = np.spacing(np.maximum(np.abs(p_ref), np.abs(p)))
        # The momentum is the gradient the step applied (to the rounding of p - lr * g)...
        np.testing.assert_array_less(np.abs(p_ref - (p0 - SGD_LR * g_ref)), ulp * 1.01)
        # ...so the sharded parameters are off by at most lr times the gradient tolerance.
        np.testing.assert_array_less(np.abs(p - p_ref), SGD_LR * GRAD_RTOL * scale + ulp)
    specs = [str(x.sharding.spec) for x in b]
    assert "PartitionSpec('expert',)" in specs or "P('expert',)" in specs
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(8, 2)
