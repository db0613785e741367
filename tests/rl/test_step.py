"""SFT and GRPO steps: every method builds and runs one step on `tiny`."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from tests.rl.rollouts import task_rollout
from trace_jax import tasks
from trace_jax.models import init_model
from trace_jax.rl.advantages import grpo_advantages
from trace_jax.rl.config import GRPOConfig, make_optimizer
from trace_jax.rl.methods import METHODS, get_method
from trace_jax.rl.step import grpo_step, old_logprobs, sft_step

GRPO = GRPOConfig(group_size=2, learning_rate=1e-3)


def _config(name: str | None = None):
    """The tiny model with as many blocks as the step can treat differently: two for a method
    that guides some of its layers only (TRACE, the deeper half: a guided and an unguided
    block), else one (SFT, and methods that quantize every block alike); a block less is about
    40% less to compile."""
    if name is not None:
        setup = get_method(name).setup("nvfp4", tiny.N_LAYERS)
        guided = {key.split("/")[0] for key in setup.capture}
        if 0 < len(guided) < tiny.N_LAYERS:
            return tiny.model_config()
    return tiny.model_config(n_layers=1)


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_sft_step_lowers_the_loss():
    model = init_model(_config(), seed=0)
    opt = nnx.Optimizer(model, make_optimizer(GRPO), wrt=nnx.Param)
    batch = tasks.encode_sft_batch(list(itertools.islice(tasks.train_stream(0, levels=(1,)), 8)))
    args = [jnp.asarray(a) for a in (batch.tokens, batch.lengths, batch.target_mask)]
    losses = [float(sft_step(model, opt, *args)["sft_nll"]) for _ in range(5)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_runs_one_grpo_step(name):
    cfg = _config(name)
    model = init_model(cfg, seed=1)
    opt = nnx.Optimizer(model, make_optimizer(GRPO), wrt=nnx.Param)
    setup = get_method(name).setup("nvfp4", cfg.n_layers)
    roll = task_rollout(model, setup, n_problems=2, group_size=GRPO.group_size)
    assert set(roll.guidance) == set(setup.capture)
    # A random policy earns no reward: use a synthetic one so the advantages are not all zero.
    rewards = jnp.asarray([1.0, 0.0, 0.0, 1.0])
    adv = grpo_advantages(rewards, GRPO.group_size)
    lp_old = old_logprobs(model, roll, setup=setup, grpo=GRPO, temperature=1.0)
    before = _params(model)
    metrics = grpo_step(model, opt, roll, adv, lp_old, setup=setup, grpo=GRPO, temperature=1.0)
    assert all(np.isfinite(float(v)) for k, v in metrics.items() if "pearson" not in k)
    assert float(metrics["grad_norm"]) > 0
    assert int(metrics["guidance_rtn_fallback_rows"]) == 0  # routing replay: all guided
    # The trainer's own router mostly agrees with the rollout's (same policy, FP4 noise apart).
    assert 0.5 < float(metrics["router_agreement"]) <= 1.0
    after = _params(model)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
