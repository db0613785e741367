"""GRPOConfig validation, loss binding, and the AdamW + warmup/cosine + clipping optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trace_jax.rl import GRPOConfig, make_optimizer, make_schedule


def test_defaults_follow_the_paper():
    cfg = GRPOConfig()
    assert cfg.is_cap == 5.0 and cfg.max_staleness == 3 and cfg.routing_replay
    assert cfg.loss_kwargs("ppo_clip")["is_cap"] == 5.0
    assert cfg.loss_kwargs("tbpo")["band"] == (0.2, 5.0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"group_size": 1}, "group_size"),
        ({"advantage": "rloo"}, "advantage"),
        ({"clip_eps_low": 1.0}, "clip_eps_low"),
        ({"clip_eps_high": 0.0}, "clip_eps_high"),
        ({"is_cap": 0.5}, "is_cap"),
        ({"beta": -0.1}, "beta"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"tbpo_band": (1.0, 2.0)}, "tbpo_band"),
        ({"loss_aggregation": "sum"}, "loss_aggregation"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"grad_clip_norm": 0.0}, "grad_clip_norm"),
        ({"mini_batches": 0}, "mini_batches"),
        ({"mini_batches": 5}, "mini_batches and max_staleness disagree"),
        ({"adam_eps": float("nan")}, "adam_eps"),
        ({"learning_rate": float("inf")}, "learning_rate"),
    ],
)
def test_invalid_values_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**overrides)


def test_several_errors_are_reported_together():
    with pytest.raises(ValueError, match=r"group_size.*beta"):
        GRPOConfig(group_size=0, beta=-1.0)


def test_schedule_warmup_then_cosine():
    cfg = GRPOConfig(learning_rate=1e-3, warmup_steps=2, min_lr_ratio=0.1)
    sched = make_schedule(cfg, total_steps=10)
    np.testing.assert_allclose(
        [sched(0), sched(1), sched(2), sched(10)], [0.0, 5e-4, 1e-3, 1e-4], rtol=1e-5
    )
    # halfway through the cosine (step 6 of 2..10): (1 + 0.1) / 2 of the peak
    np.testing.assert_allclose(sched(6), 1e-3 * (0.1 + 0.9 * 0.5), rtol=1e-5)
    const = make_schedule(cfg)
    np.testing.assert_allclose([const(1), const(2), const(1000)], [5e-4, 1e-3, 1e-3], rtol=1e-6)
    with pytest.raises(ValueError, match="total_steps"):
        make_schedule(cfg, total_steps=2)


def test_optimizer_steps_a_param_tree():
    cfg = GRPOConfig(learning_rate=0.1, warmup_steps=1, weight_decay=0.5, grad_clip_norm=1.0)
    tx = make_optimizer(cfg, total_steps=5)
    params = {"w": jnp.ones((2, 3)), "norm": {"scale": jnp.ones(3)}}
    state = tx.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    for _ in range(2):  # step 0 has lr 0; step 1 decays matrices only
        updates, state = tx.update(zero, state, params)
        params = optax.apply_updates(params, updates)
    assert float(params["w"][0, 0]) < 1.0
    np.testing.assert_array_equal(params["norm"]["scale"], 1.0)

    huge = jax.tree.map(lambda p: jnp.full_like(p, 1e30), params)
    updates, state = tx.update(huge, state, params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
    # clipping: the Adam moments saw the clipped gradient (global norm 1), not 1e30
    mu = [s for s in jax.tree.leaves(state) if getattr(s, "shape", None) == (2, 3)]
    assert mu and all(float(jnp.max(jnp.abs(x))) < 1.0 for x in mu)


def test_make_optimizer_is_one_object_per_setting():
    """The transformation is static metadata of nnx.Optimizer: an equal setting must give the
    identical object, or every run and resumed chunk recompiles its jitted train step."""
    from trace_jax.rl.config import GRPOConfig, make_optimizer

    a = make_optimizer(GRPOConfig(learning_rate=1e-3), 10)
    assert make_optimizer(GRPOConfig(learning_rate=1e-3), 10) is a
    assert make_optimizer(GRPOConfig(learning_rate=2e-3), 10) is not a
