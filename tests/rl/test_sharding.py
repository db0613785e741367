"""A GRPO step on a (data, expert) mesh of 8 host devices equals the unsharded step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from tests.rl.rollouts import task_rollout
from trace_jax.models import init_model
from trace_jax.rl.advantages import grpo_advantages
from trace_jax.rl.config import GRPOConfig, make_optimizer
from trace_jax.rl.methods import get_method
from trace_jax.rl.sharding import make_mesh, shard_batch, shard_model, shard_optimizer
from trace_jax.rl.step import grpo_step, old_logprobs

CFG = tiny.model_config(dtype=jnp.float32)
GRPO = GRPOConfig(group_size=2, learning_rate=1e-3)


def _build():
    model = init_model(CFG, seed=1)
    return model, nnx.Optimizer(model, make_optimizer(GRPO), wrt=nnx.Param)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
def test_sharded_step_equals_unsharded():
    setup = get_method("trace").setup("nvfp4", CFG.n_layers)
    model, opt = _build()
    roll = task_rollout(model, setup, n_problems=4, group_size=2)
    adv = grpo_advantages(jnp.asarray([1.0, 0, 0, 1, 1, 0, 0, 1]), 2)
    lp = old_logprobs(model, roll, setup=setup, grpo=GRPO, temperature=1.0)
    kw = dict(setup=setup, grpo=GRPO, temperature=1.0)
    ref = grpo_step(model, opt, roll, adv, lp, **kw)

    mesh = make_mesh(4, 2)
    model2, opt2 = _build()
    shard_model(model2, mesh)
    shard_optimizer(opt2, model2, mesh)
    roll2, adv2, lp2 = shard_batch((roll, adv, lp), mesh, batch_size=8)
    with jax.set_mesh(mesh):
        got = grpo_step(model2, opt2, roll2, adv2, lp2, **kw)
    np.testing.assert_allclose(float(got["loss"]), float(ref["loss"]), rtol=1e-4)
    np.testing.assert_allclose(float(got["grad_norm"]), float(ref["grad_norm"]), rtol=1e-4)
    a = jax.tree.leaves(nnx.state(model, nnx.Param))
    b = jax.tree.leaves(nnx.state(model2, nnx.Param))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=5e-5)
    specs = [str(x.sharding.spec) for x in b]
    assert "PartitionSpec('expert',)" in specs or "P('expert',)" in specs
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(8, 2)
