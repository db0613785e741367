"""GRPO / Dr. GRPO group advantages against hand-computed values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rl import ADVANTAGES, get_advantage_fn, grpo_advantages


def test_grpo_matches_hand_computed_groups():
    # Group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.5773503.
    # Group 1: all equal -> advantage 0.
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    a = 0.5 / (np.sqrt(1.0 / 3.0) + 1e-6)  # 0.8660239
    expected = np.array([[a, -a, -a, a], [0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(grpo_advantages(rewards), expected, rtol=1e-6, atol=1e-7)
    flat = grpo_advantages(rewards.reshape(-1), group_size=4)
    assert flat.shape == (8,)
    np.testing.assert_allclose(flat, expected.reshape(-1), rtol=1e-6, atol=1e-7)


def test_grpo_three_samples_and_population_std():
    # 3, 1, 2: mean 2, deviations 1, -1, 0; unbiased var 2 / 2 = 1; population var 2 / 3.
    r = jnp.array([3.0, 1.0, 2.0])
    np.testing.assert_allclose(
        grpo_advantages(r, 3, eps=0.0), [1.0, -1.0, 0.0], rtol=1e-6, atol=1e-7
    )
    pop = np.sqrt(2.0 / 3.0)
    np.testing.assert_allclose(
        grpo_advantages(r, 3, eps=0.0, ddof=0), [1 / pop, -1 / pop, 0.0], rtol=1e-6, atol=1e-7
    )


def test_dr_grpo_only_centres():
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 5.0, 1.0, 0.0, 2.0])
    expected = [0.5, -0.5, -0.5, 0.5, 3.0, -1.0, -2.0, 0.0]
    np.testing.assert_allclose(ADVANTAGES["dr_grpo"](r, 4), expected, rtol=1e-6)
    np.testing.assert_allclose(grpo_advantages(r, 4, std_normalize=False), expected, rtol=1e-6)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="need group_size"):
        grpo_advantages(jnp.ones(6))
    with pytest.raises(ValueError, match="do not split"):
        grpo_advantages(jnp.ones(6), group_size=4)
    with pytest.raises(ValueError, match="group_size=3"):
        grpo_advantages(jnp.ones((2, 4)), group_size=3)
    with pytest.raises(ValueError, match="too small"):
        grpo_advantages(jnp.ones((2, 1)))
    with pytest.raises(ValueError, match="expected one of"):
        get_advantage_fn("ppo")
