"""PPO-clip with truncated IS, k3 KL, TBPO and gap metrics, against hand-computed numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rl import (
    GRPOConfig,
    kl_k3,
    logprob_gap_metrics,
    ppo_clip_loss,
    tbpo_loss,
    truncated_is_weight,
)

LN = np.log
# The losses take every hyper-parameter explicitly; their one definition is `GRPOConfig`.
PPO = GRPOConfig().loss_kwargs("ppo_clip")
TBPO = GRPOConfig().loss_kwargs("tbpo")


def _ppo_example():
    """B=2, S=3; slot 0 is prompt (garbage values there must not matter).

    seq 0 (A=+1): slot 1 ratio 1.5 (clipped at 1.28), IS raw 2; slot 2 ratio 0.9, IS raw 10 -> 5.
    seq 1 (A=-2): slot 1 ratio 0.5 (clipped at 0.8), IS raw 0.5; slot 2 not a response token.
    """
    old = np.array([[0.0, -1.0, -2.0], [0.0, -0.5, -3.0]])
    new = old + np.array([[50.0, LN(1.5), LN(0.9)], [-50.0, LN(0.5), 30.0]])
    roll = old - np.array([[-1e9, LN(2.0), LN(10.0)], [1e9, LN(0.5), 0.0]])
    mask = np.array([[False, True, True], [False, True, False]])
    adv = np.array([1.0, -2.0])
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return f32(new), f32(old), f32(roll), jnp.asarray(mask), f32(adv)


def test_ppo_clip_hand_example():
    new, old, roll, mask, adv = _ppo_example()
    kw = PPO | dict(logp_old=old, logp_rollout=roll, advantages=adv, mask=mask)
    kw |= dict(clip_eps_low=0.2, clip_eps_high=0.28, is_cap=5.0)
    # Token losses: -w * min(rA, clip(r)A): -2 * 1.28, -5 * 0.9, 0.5 * 1.6.
    tok = [-2.56, -4.5, 0.8]
    loss, m = ppo_clip_loss(new, **kw)
    np.testing.assert_allclose(loss, sum(tok) / 3, rtol=1e-5)  # -2.0866667
    loss_seq, _ = ppo_clip_loss(new, **(kw | {"aggregation": "seq_mean"}))
    np.testing.assert_allclose(loss_seq, ((tok[0] + tok[1]) / 2 + tok[2]) / 2, rtol=1e-5)
    np.testing.assert_allclose(m["clip_frac"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["is_trunc_frac"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["is_weight_mean"], (2 + 5 + 0.5) / 3, rtol=1e-5)
    np.testing.assert_allclose(m["ratio_mean"], (1.5 + 0.9 + 0.5) / 3, rtol=1e-5)
    np.testing.assert_allclose(m["kl"], 0.0)
    assert float(m["dual_clip_frac"]) == 0.0

    # Gradient: only the unclipped token (seq 0, slot 2) pushes: d/dlogp (-w A r) / 3 tokens.
    g = jax.grad(lambda x: ppo_clip_loss(x, **kw)[0])(new)
    expected = np.zeros((2, 3))
    expected[0, 2] = -5.0 * 1.0 * 0.9 / 3
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)


def test_ppo_kl_penalty_hand_example():
    new, old, roll, mask, adv = _ppo_example()
    ref = new.at[0, 1].add(LN(2.0))  # k3 = 2 - ln 2 - 1 at one token, 0 elsewhere
    kw = PPO | dict(logp_old=old, logp_rollout=roll, advantages=adv, mask=mask, logp_ref=ref)
    kw |= dict(clip_eps_low=0.2, clip_eps_high=0.28, is_cap=5.0)
    k3 = 1.0 - LN(2.0)
    loss, m = ppo_clip_loss(new, **(kw | {"beta": 0.1}))
    np.testing.assert_allclose(loss, (-2.56 - 4.5 + 0.8 + 0.1 * k3) / 3, rtol=1e-5)
    np.testing.assert_allclose(m["kl"], k3 / 3, rtol=1e-5)
    with pytest.raises(ValueError, match="logp_ref"):
        ppo_clip_loss(new, **(kw | {"logp_ref": None, "beta": 0.1}))


def test_dual_clip_bounds_negative_advantage_loss():
    new = jnp.array([[LN(4.0)]], jnp.float32)
    z = jnp.zeros((1, 1))
    kw = PPO | dict(logp_old=z, logp_rollout=z, advantages=jnp.array([-1.0]), mask=jnp.ones((1, 1)))
    loss, _ = ppo_clip_loss(new, **kw)
    np.testing.assert_allclose(loss, 4.0, rtol=1e-6)  # -A r, unbounded without dual clip
    loss, m = ppo_clip_loss(new, **(kw | {"dual_clip": 3.0}))
    np.testing.assert_allclose(loss, 3.0, rtol=1e-6)
    assert float(m["dual_clip_frac"]) == 1.0
    g = jax.grad(lambda x: ppo_clip_loss(x, **(kw | {"dual_clip": 3.0}))[0])(new)
    assert float(g[0, 0]) == 0.0


def test_truncated_is_weight_caps_at_5_and_has_no_gradient():
    d = jnp.array([LN(2.0), LN(5.0), LN(10.0), 100.0, -3.0], jnp.float32)
    w, trunc = truncated_is_weight(d, jnp.zeros_like(d), 5.0)
    np.testing.assert_allclose(w, [2.0, 5.0, 5.0, 5.0, np.exp(-3.0)], rtol=1e-5)
    np.testing.assert_array_equal(trunc, [False, False, True, True, False])
    for argnum in (0, 1):
        g = jax.grad(lambda a, b: jnp.sum(truncated_is_weight(a, b, 5.0)[0]), argnum)(
            d, jnp.zeros_like(d)
        )
        np.testing.assert_array_equal(g, 0.0)
    w, trunc = truncated_is_weight(d, jnp.zeros_like(d), None)
    np.testing.assert_array_equal(w, 1.0)
    assert not bool(jnp.any(trunc))

    # Through the loss: no gradient into the old or the rollout log-probs.
    new, old, roll, mask, adv = _ppo_example()
    for name, x in (("logp_old", old), ("logp_rollout", roll)):
        args = PPO | dict(logp_old=old, logp_rollout=roll, advantages=adv, mask=mask)

        def f(v, name=name, args=args):
            return ppo_clip_loss(new, **(args | {name: v}))[0]

        np.testing.assert_array_equal(jax.grad(f)(x), 0.0)


def test_kl_k3_nonnegative_and_zero_when_equal():
    a, b = jax.random.normal(jax.random.key(0), (2, 64)) * 2.0
    k = kl_k3(a, b)
    assert bool(jnp.all(k >= 0.0))
    np.testing.assert_array_equal(kl_k3(a, a), 0.0)
    # e^u - 1 - u at u = ln 3: 3 - 1 - ln 3
    np.testing.assert_allclose(kl_k3(jnp.array(0.0), jnp.array(LN(3.0))), 2 - LN(3.0), rtol=1e-6)


def _tbpo_example():
    """Five sequences, S=4, eps 0.2, dual clip c=3, band (0.2, 5), cap 5.

    seq 0 (A=+1, 2 tok): ratios 1.2, 1.5 -> s = sqrt(1.8) = 1.3416 > 1.2: clipped, w = 2.
    seq 1 (A=-1, 3 tok): ratios 4, 4, 4 -> s = 4 > c: dual-clipped at 3, w = 8 -> 5 (truncated).
    seq 2 (A=+0.5, 1 tok): ratio 8 -> s = 8 > 5: dropped.
    seq 3 (A=+1): no response token: ignored.
    seq 4 (A=+1, 2 tok): ratios 1.1, 0.9 -> s = sqrt(0.99) = 0.99499, unclipped, w = 1.
    """
    lr = np.zeros((5, 4))
    lw = np.zeros((5, 4))  # log(pi_old / pi_roll)
    mask = np.zeros((5, 4), bool)
    mask[0, 1:3] = True
    lr[0, 1:3] = LN([1.2, 1.5])
    lw[0, 1:3] = LN(2.0)
    mask[1, 1:4] = True
    lr[1, 1:4] = LN(4.0)
    lw[1, 1:4] = LN(8.0)
    mask[2, 3] = True
    lr[2, 3] = LN(8.0)
    mask[4, 0:2] = True
    lr[4, 0:2] = LN([1.1, 0.9])
    lr[~mask] = 77.0  # garbage outside the mask
    old = -np.arange(20.0).reshape(5, 4) / 10
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    adv = f32([1.0, -1.0, 0.5, 1.0, 1.0])
    return f32(old + lr), f32(old), f32(old - lw), jnp.asarray(mask), adv


def test_tbpo_hand_example():
    new, old, roll, mask, adv = _tbpo_example()
    kw = TBPO | dict(logp_old=old, logp_rollout=roll, advantages=adv, mask=mask)
    kw |= dict(clip_eps_low=0.2, clip_eps_high=0.2, is_cap=5.0, dual_clip=3.0, band=(0.2, 5.0))
    s4 = np.sqrt(0.99)
    seq = np.array([-1.2 * 2.0, 3.0 * 5.0, 0.0, -s4 * 1.0])  # valid sequences 0, 1, 2, 4
    n = np.array([2.0, 3.0, 1.0, 2.0])
    loss, m = tbpo_loss(new, **kw)
    np.testing.assert_allclose(loss, np.sum(seq * n) / n.sum(), rtol=1e-5)  # 4.7762531
    loss_seq, _ = tbpo_loss(new, **(kw | {"aggregation": "seq_mean"}))
    np.testing.assert_allclose(loss_seq, seq.mean(), rtol=1e-5)  # 2.9012531
    for key in ("clip_frac", "dual_clip_frac", "drop_frac", "is_trunc_frac"):
        np.testing.assert_allclose(m[key], 0.25, rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(m["ratio_mean"], (np.sqrt(1.8) + 4 + 8 + s4) / 4, rtol=1e-5)
    np.testing.assert_allclose(m["is_weight_mean"], (2 + 5 + 1 + 1) / 4, rtol=1e-5)

    # Only seq 4 has a gradient: d(-s)/dlogp_t = -s / 2 per token, weighted 2 / 8 tokens.
    g = jax.grad(lambda x: tbpo_loss(x, **kw)[0])(new)
    expected = np.zeros((5, 4))
    expected[4, 0:2] = -s4 / 2 * 2 / 8
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)

    # A narrower band drops seq 0 (s = 1.34) and seq 1 too.
    _, m2 = tbpo_loss(new, **(kw | {"band": (0.5, 1.3)}))
    np.testing.assert_allclose(m2["drop_frac"], 0.75, rtol=1e-6)


def test_tbpo_token_advantages_reduce_to_sequence_mean():
    new, old, roll, mask, adv = _tbpo_example()
    kw = TBPO | dict(logp_old=old, logp_rollout=roll, mask=mask)
    a, _ = tbpo_loss(new, **kw, advantages=adv)
    b, _ = tbpo_loss(new, **kw, advantages=jnp.broadcast_to(adv[:, None], mask.shape))
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_gap_metrics_match_numpy():
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    lr = -jax.random.exponential(k1, (4, 16))
    lt = lr + 0.3 * jax.random.normal(k2, (4, 16))
    mask = jax.random.bernoulli(k3, 0.7, (4, 16))
    got = logprob_gap_metrics(lt, lr, mask)
    m = np.asarray(mask)
    t, r = np.asarray(lt, np.float64)[m], np.asarray(lr, np.float64)[m]
    d = t - r
    np.testing.assert_allclose(got["gap_mean"], np.mean(np.abs(d)), rtol=1e-5)
    np.testing.assert_allclose(got["gap_max"], np.max(np.abs(d)), rtol=1e-5)
    np.testing.assert_allclose(got["kl_k3"], np.mean(np.exp(d) - 1 - d), rtol=1e-4)
    np.testing.assert_allclose(got["pearson_logp"], np.corrcoef(t, r)[0, 1], rtol=1e-5)
    np.testing.assert_allclose(
        got["pearson_prob"], np.corrcoef(np.exp(t), np.exp(r))[0, 1], rtol=1e-5
    )
    same = logprob_gap_metrics(lr, lr, mask)
    assert float(same["gap_max"]) == 0.0 and float(same["kl_k3"]) == 0.0
    np.testing.assert_allclose(same["pearson_logp"], 1.0, rtol=1e-6)


def test_loss_argument_errors():
    new, old, roll, mask, adv = _ppo_example()
    kw = dict(logp_old=old, logp_rollout=roll, advantages=adv, mask=mask)
    ppo, tbpo = PPO | kw, TBPO | kw  # every hyper-parameter valid but the one under test
    with pytest.raises(ValueError, match="aggregation"):
        ppo_clip_loss(new, **(ppo | {"aggregation": "sum"}))
    with pytest.raises(ValueError, match="clip_eps_low"):
        ppo_clip_loss(new, **(ppo | {"clip_eps_low": 1.0}))
    with pytest.raises(ValueError, match="is_cap"):
        ppo_clip_loss(new, **(ppo | {"is_cap": 0.5}))
    with pytest.raises(ValueError, match="advantages have shape"):
        ppo_clip_loss(new, **(ppo | {"advantages": jnp.ones(3)}))
    with pytest.raises(ValueError, match="mask has shape"):
        ppo_clip_loss(new, **(ppo | {"mask": jnp.ones((2, 2), bool)}))
    with pytest.raises(ValueError, match="band"):
        tbpo_loss(new, **(tbpo | {"band": (1.1, 2.0)}))
    with pytest.raises(ValueError, match="dual_clip"):
        tbpo_loss(new, **(tbpo | {"dual_clip": 1.0}))
