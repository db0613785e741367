r"""Policy losses and train-rollout gap metrics: pure functions on `[B, S]` arrays.

Three policies meet in an RL update:

* pi_theta (`logp_new`): the trainer's current policy, the only input with a gradient;
* pi_old (`logp_old`): the trainer's own policy at the start of the update (its log-probs of the
  rollout's tokens before the first mini-batch step), or the rollout's log-probs where the caller
  wants the rollout to be the behaviour policy;
* pi_roll (`logp_rollout`): the policy that really sampled the tokens (FP4 or BF16 rollout).

PPO-clip (token level), with truncated importance sampling (TIS) against the rollout:

    r_t  = pi_theta / pi_old                   w_t = sg(min(pi_old / pi_roll, C))
    l_t  = -w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)  [+ beta * k3_t]
    (dual clip, optional: for A < 0, l_t = min(l_t, -w_t * c A))

TBPO (QaRL's trust-band objective, sequence level):

    s_i  = exp(mean_t log(pi_theta / pi_old))  (geometric mean of the token ratios)
    J_i  = min(s_i A, clip(s_i, 1 - eps_low, 1 + eps_high) A);  for A < 0: max(J_i, c A)
    w_i  = sg(min(exp(mean_t log(pi_old / pi_roll)), C))
    l_i  = -w_i J_i  [+ beta * mean_t k3],  dropped (0) when s_i leaves the band [b_lo, b_hi]

Every function takes a response mask `mask` (bool/float [B, S]); positions outside it never
contribute, whatever they hold (their values are replaced before any exp, so no NaN leaks into
gradients). Every loss returns `(loss, metrics)`, ready for `jax.value_and_grad(has_aux=True)`.
The losses take every hyper-parameter as a required keyword: their values are defined once, in
`trace_jax.rl.GRPOConfig` (`GRPOConfig.loss_kwargs`, bound by `bind_loss`).

Axis legend: B sequences, S slots (prompt + response, response tokens under `mask`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token_mean", "seq_mean")

# |log ratio| is clamped here before exp (a ratio of e^20 is far outside any clip range).
_MAX_LOG_RATIO = 20.0

Metrics = dict[str, jax.Array]
LossFn = Callable[..., tuple[jax.Array, Metrics]]


# ---------------------------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------------------------


def _mask(mask: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    m = jnp.asarray(mask)
    if m.shape != shape:
        raise ValueError(f"mask has shape {m.shape}; expected the log-prob shape {shape}")
    return m.astype(bool)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Mean of `x` over `mask` (0 where the mask is empty)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask, x, 0.0), axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1.0)


def aggregate(token_values: jax.Array, mask: jax.Array, how: str) -> jax.Array:
    """Reduces per-token values `[B, S]` to a scalar.

    "token_mean": the mean over every response token of the batch (long answers weigh more);
    "seq_mean": the mean over sequences of each sequence's token mean (sequences with no response
    token are left out).
    """
    if how == "token_mean":
        return masked_mean(token_values, mask)
    if how == "seq_mean":
        per_seq = masked_mean(token_values, mask, axis=-1)
        has = jnp.any(mask, axis=-1)
        return masked_mean(per_seq, has)
    raise ValueError(f"unknown loss aggregation {how!r}; expected one of {AGGREGATIONS}")


def _token_advantages(advantages: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Advantages `[B]` (per sequence) or `[B, S]` (per token) as float32 `[B, S]`."""
    a = jnp.asarray(advantages, jnp.float32)
    if a.shape == shape[:1]:
        return jnp.broadcast_to(a[:, None], shape)
    if a.shape == shape:
        return a
    raise ValueError(f"advantages have shape {a.shape}; expected {shape[:1]} or {shape}")


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def kl_k3(logp_p: jax.Array, logp_q: jax.Array) -> jax.Array:
    """Per-sample k3 estimate of KL(p || q) on samples drawn from p: `e^u - 1 - u`, u = lq - lp.

    Unbiased, never negative, exactly 0 where the log-probs are equal.
    """
    u = jnp.clip(logp_q - logp_p, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.expm1(u) - u


def truncated_is_weight(
    logp_old: jax.Array, logp_rollout: jax.Array, cap: float | None
) -> tuple[jax.Array, jax.Array]:
    """Token-level truncated importance weight against the rollout policy, without gradient.

    Returns `(w, truncated)`: `w = min(pi_old / pi_roll, cap)` (1 everywhere when `cap` is None)
    and the bool mask of tokens where the cap bit.
    """
    log_w = jax.lax.stop_gradient(logp_old - logp_rollout)
    if cap is None:
        return jnp.ones_like(log_w), jnp.zeros(log_w.shape, bool)
    log_cap = math.log(cap)
    truncated = log_w > log_cap
    return jnp.exp(jnp.minimum(log_w, log_cap)), truncated


def _check_clip(clip_eps_low: float, clip_eps_high: float, dual_clip: float | None, is_cap):
    if not 0.0 < clip_eps_low < 1.0:
        raise ValueError(f"clip_eps_low must be in (0, 1); got {clip_eps_low}")
    if not clip_eps_high > 0.0:
        raise ValueError(f"clip_eps_high must be > 0; got {clip_eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None); got {dual_clip}")
    if is_cap is not None and not is_cap >= 1.0:
        raise ValueError(f"is_cap must be >= 1 (or None); got {is_cap}")


def _clipped_objective(ratio, adv, clip_eps_low, clip_eps_high, dual_clip):
    """Per-sample PPO loss `-min(r A, clip(r) A)`, dual-clipped for A < 0; and both clip masks."""
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = jnp.maximum(-adv * ratio, -adv * clipped_ratio)
    # Where the clipped branch wins (and is flat): no gradient from this sample.
    above = (adv > 0) & (ratio > 1.0 + clip_eps_high)
    below = (adv < 0) & (ratio < 1.0 - clip_eps_low)
    clipped = above | below
    if dual_clip is None:
        return loss, clipped, jnp.zeros(ratio.shape, bool)
    dual = (adv < 0) & (ratio > dual_clip)
    return jnp.where(adv < 0, jnp.minimum(loss, -adv * dual_clip), loss), clipped, dual


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def ppo_clip_loss(
    logp_new: jax.Array,
    *,
    logp_old: jax.Array,
    logp_rollout: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    logp_ref: jax.Array | None = None,
    clip_eps_low: float,
    clip_eps_high: float,
    is_cap: float | None,
    beta: float,
    dual_clip: float | None,
    aggregation: str,
) -> tuple[jax.Array, Metrics]:
    """GRPO/PPO clipped token loss with truncated IS against the rollout (see the module doc).

    Args:
      logp_new: float [B, S], pi_theta's log-probs of the rollout tokens (differentiated).
      logp_old: float [B, S], pi_old's (no gradient flows into it).
      logp_rollout: float [B, S], the rollout's (`Rollout.logprobs`).
      advantages: float [B] per sequence or [B, S] per token.
      mask: bool [B, S], the response tokens.
      logp_ref: float [B, S], a reference policy for the KL penalty (needed when beta > 0).
      clip_eps_low, clip_eps_high: the clip range [1 - eps_low, 1 + eps_high] of r_t.
      is_cap: C, the truncation of the importance weight pi_old / pi_roll (None: no correction).
      beta: weight of the k3 KL(pi_theta || pi_ref) penalty.
      dual_clip: c > 1, bounds the loss of negative-advantage tokens at -c A (None: off).
      aggregation: "token_mean" or "seq_mean".

    Returns:
      `(loss, metrics)`; metrics (scalars, over response tokens): "pg_loss", "kl" (0 without a
      reference), "clip_frac", "dual_clip_frac", "is_trunc_frac", "is_weight_mean", "ratio_mean".
    """
    _check_clip(clip_eps_low, clip_eps_high, dual_clip, is_cap)
    if beta < 0:
        raise ValueError(f"beta must be >= 0; got {beta}")
    if beta > 0 and logp_ref is None:
        raise ValueError(f"beta={beta} > 0 needs the reference log-probs logp_ref")
    shape = jnp.shape(logp_new)
    m = _mask(mask, shape)
    adv = _token_advantages(advantages, shape)

    log_ratio = jnp.where(m, logp_new - jax.lax.stop_gradient(logp_old), 0.0)
    ratio = jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    pg, clipped, dual = _clipped_objective(ratio, adv, clip_eps_low, clip_eps_high, dual_clip)
    w, truncated = truncated_is_weight(
        jnp.where(m, logp_old, 0.0), jnp.where(m, logp_rollout, 0.0), is_cap
    )
    pg = w * pg

    if logp_ref is None:
        kl = jnp.zeros(shape, jnp.float32)
    else:
        kl = kl_k3(jnp.where(m, logp_new, 0.0), jnp.where(m, logp_ref, 0.0))
    token_loss = pg + beta * kl if beta > 0 else pg
    loss = aggregate(token_loss, m, aggregation)
    metrics = {
        "pg_loss": aggregate(pg, m, aggregation),
        "kl": masked_mean(kl, m),
        "clip_frac": masked_mean(clipped.astype(jnp.float32), m),
        "dual_clip_frac": masked_mean(dual.astype(jnp.float32), m),
        "is_trunc_frac": masked_mean(truncated.astype(jnp.float32), m),
        "is_weight_mean": masked_mean(w, m),
        "ratio_mean": masked_mean(jax.lax.stop_gradient(ratio), m),
    }
    return loss, metrics


def tbpo_loss(
    logp_new: jax.Array,
    *,
    logp_old: jax.Array,
    logp_rollout: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    logp_ref: jax.Array | None = None,
    clip_eps_low: float,
    clip_eps_high: float,
    is_cap: float | None,
    beta: float,
    dual_clip: float,
    band: tuple[float, float],
    aggregation: str,
) -> tuple[jax.Array, Metrics]:
    """QaRL's Trust-Band Policy Optimization: sequence-level ratio, dual clip, trust band.

    Arguments as `ppo_clip_loss`, except:
      advantages: one per sequence, [B] (a [B, S] array is reduced to its token mean).
      is_cap: C for the sequence-level weight `min(exp(mean_t log(pi_old / pi_roll)), C)`.
      dual_clip: c > 1: the loss of a negative-advantage sequence is at most -c A (two-sided
        clipping of negative samples; c = 1 + eps_high clips them exactly to the clip range).
      band: (b_lo, b_hi), b_lo < 1 < b_hi: sequences whose ratio s_i lies outside are dropped
        (no loss, no gradient; they still count in the denominators, like fully clipped ones).
      aggregation: "token_mean" weighs each sequence by its response length, "seq_mean" does not.

    Returns:
      `(loss, metrics)`; metrics are fractions of the sequences that have response tokens:
      "pg_loss", "kl", "clip_frac", "dual_clip_frac", "drop_frac", "is_trunc_frac",
      "is_weight_mean", "ratio_mean" (mean s_i).
    """
    _check_clip(clip_eps_low, clip_eps_high, dual_clip, is_cap)
    b_lo, b_hi = band
    if not 0.0 <= b_lo < 1.0 < b_hi:
        raise ValueError(f"band must satisfy 0 <= b_lo < 1 < b_hi; got {band}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0; got {beta}")
    if beta > 0 and logp_ref is None:
        raise ValueError(f"beta={beta} > 0 needs the reference log-probs logp_ref")
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"unknown loss aggregation {aggregation!r}; expected one of {AGGREGATIONS}"
        )
    shape = jnp.shape(logp_new)
    m = _mask(mask, shape)
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.shape == shape:
        adv = masked_mean(adv, m, axis=-1)
    elif adv.shape != shape[:1]:
        raise ValueError(f"advantages have shape {adv.shape}; expected {shape[:1]} or {shape}")

    n_tok = jnp.sum(m, axis=-1).astype(jnp.float32)  # [B]
    has = n_tok > 0
    log_s = masked_mean(logp_new - jax.lax.stop_gradient(logp_old), m, axis=-1)  # [B]
    log_s_const = jax.lax.stop_gradient(log_s)
    lo = -math.inf if b_lo == 0.0 else math.log(b_lo)
    in_band = (log_s_const >= lo) & (log_s_const <= math.log(b_hi))
    keep = has & in_band
    # Dropped sequences never reach exp (no inf * 0 in the backward pass).
    s = jnp.exp(jnp.clip(jnp.where(keep, log_s, 0.0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    pg, clipped, dual = _clipped_objective(s, adv, clip_eps_low, clip_eps_high, dual_clip)

    log_w = masked_mean(jnp.where(m, logp_old, 0.0) - jnp.where(m, logp_rollout, 0.0), m, axis=-1)
    w, truncated = truncated_is_weight(log_w, jnp.zeros_like(log_w), is_cap)
    pg = jnp.where(keep, w * pg, 0.0)

    if logp_ref is None:
        kl = jnp.zeros(shape[:1], jnp.float32)
    else:
        kl = masked_mean(
            kl_k3(jnp.where(m, logp_new, 0.0), jnp.where(m, logp_ref, 0.0)), m, axis=-1
        )
    seq_loss = pg + jnp.where(keep, beta * kl, 0.0) if beta > 0 else pg

    def agg(v):
        if aggregation == "token_mean":
            return jnp.sum(v * n_tok) / jnp.maximum(jnp.sum(n_tok), 1.0)
        return masked_mean(v, has)

    s_all = jnp.exp(jnp.clip(log_s_const, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # incl. dropped

    def frac(b):
        return masked_mean(b.astype(jnp.float32), has)

    metrics = {
        "pg_loss": agg(pg),
        "kl": masked_mean(kl, has),
        "clip_frac": frac(clipped & keep),
        "dual_clip_frac": frac(dual & keep),
        "drop_frac": frac(~in_band),
        "is_trunc_frac": frac(truncated),
        "is_weight_mean": masked_mean(w, has),
        "ratio_mean": masked_mean(s_all, has),
    }
    return agg(seq_loss), metrics


# name -> loss function (the methods registry refers to these names).
LOSSES: dict[str, LossFn] = {
    "ppo_clip": ppo_clip_loss,
    "tbpo": tbpo_loss,
}


def get_loss_fn(name: str) -> LossFn:
    """The loss function called `name` (see `LOSSES`)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}")
    return LOSSES[name]


# ---------------------------------------------------------------------------------------------
# Train-rollout gap
# ---------------------------------------------------------------------------------------------


def _pearson(x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    """Pearson correlation of `x` and `y` over `mask` (NaN when either is constant there)."""
    mx, my = masked_mean(x, mask), masked_mean(y, mask)
    dx = jnp.where(mask, x - mx, 0.0)
    dy = jnp.where(mask, y - my, 0.0)
    return jnp.sum(dx * dy) / jnp.sqrt(jnp.sum(dx * dx) * jnp.sum(dy * dy))


def logprob_gap_metrics(
    logp_train: jax.Array, logp_rollout: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """How far the trainer's log-probs are from the rollout's on the response tokens.

    Returns scalars: "gap_mean" and "gap_max" of |logp_train - logp_rollout|, "kl_k3" (the k3
    estimate of KL(rollout || train) on the rollout's samples), "pearson_logp" and "pearson_prob"
    (correlation of the log-probs, and of the probabilities, over the response tokens; NaN when
    one side is constant). With no response token: 0 for all but the correlations (NaN).
    """
    shape = jnp.shape(logp_train)
    m = _mask(mask, shape)
    lt = jnp.where(m, jnp.asarray(logp_train, jnp.float32), 0.0)
    lr = jnp.where(m, jnp.asarray(logp_rollout, jnp.float32), 0.0)
    gap = jnp.abs(lt - lr)
    return {
        "gap_mean": masked_mean(gap, m),
        "gap_max": jnp.max(jnp.where(m, gap, 0.0)),
        "kl_k3": masked_mean(kl_k3(lr, lt), m),
        "pearson_logp": _pearson(lt, lr, m),
        "pearson_prob": _pearson(jnp.exp(lt), jnp.exp(lr), m),
    }
