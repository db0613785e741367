"""Float32 rounding-error bounds for tests that compare two computations of the same quantity
(grouped vs dense experts, jitted vs eager, cached decode vs the full forward).

Two float32 computations of one value may sum in different orders (XLA picks the order by shape,
fusion, vector width and version), so they agree only to rounding. The standard bound for a sum or
dot of n terms in float32, in any order, is |fl(sum) - sum| <= n u sum|terms| (u = 2**-24, first
order); two computations each within it differ by at most twice it. The bounds here are that rule
applied along the computation, in float64 numpy, and never depend on an observed error.

Axis legend: B batch, T time, D model, E experts, K top-k, F expert ffn width, V vocab, L layers.
"""

from __future__ import annotations

import numpy as np

U32 = 2.0**-24  # float32 unit roundoff
# Rounding of a few elementwise float32 operations (exp, rsqrt, silu, tanh, products), in units
# of u: XLA's transcendental functions are within a few ulps, 1 ulp <= 2 u.
ELEMENTWISE = 8


def _f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def experts_bound(moe, x, routing, *, mid_site=None, mid_slope: float = 1.0):
    """Error bounds of one float32 computation of the routed SwiGLU experts, against exact math.

    moe: a `MoE` (its w_gate, w_up [E, F, D], w_down [E, D, F]); x [B, T, D]: the experts' input
    (after the "expert_in" site); routing: its `Routing`. mid_site: the "expert_mid" site as a
    function of h (None: identity), `mid_slope` a bound on its derivative.
    Returns (h_bound [B, T, K, F], out_bound [B, T, D]) float64: bounds on |computed - exact| of
    h = silu(x W_gate^T) * (x W_up^T) and of the top-k weighted output (the shared expert left
    out: both paths compute it identically). Each dot contributes n u (|a| @ |b|); silu's slope
    is at most 1.1, so an input error e moves silu(gate) * up by at most 1.1 e |up|.
    """
    x = _f64(x)
    idx = np.asarray(routing.topk_idx)
    w = _f64(routing.topk_weights)  # [B, T, K]
    wg, wu, wd = (_f64(p[...])[idx] for p in (moe.w_gate, moe.w_up, moe.w_down))
    d, f = x.shape[-1], wg.shape[-2]
    gate, up = (np.einsum("btd,btkfd->btkf", x, m) for m in (wg, wu))
    gate_mag, up_mag = (np.einsum("btd,btkfd->btkf", np.abs(x), np.abs(m)) for m in (wg, wu))
    silu = gate / (1 + np.exp(-gate))
    h = silu * up
    h_bound = d * U32 * (1.1 * gate_mag * np.abs(up) + np.abs(silu) * up_mag)
    h_bound += ELEMENTWISE * U32 * np.abs(h)
    s = h if mid_site is None else _f64(mid_site(h.astype(np.float32)))
    s_bound = mid_slope * h_bound + ELEMENTWISE * U32 * np.abs(s)
    y = np.einsum("btkf,btkdf->btkd", s, wd)
    y_bound = f * U32 * np.einsum("btkf,btkdf->btkd", np.abs(s), np.abs(wd))
    y_bound += np.einsum("btkf,btkdf->btkd", s_bound, np.abs(wd))
    k = w.shape[-1]
    out = np.einsum("btkd,btk->btd", y, w)
    out_bound = np.einsum("btkd,btk->btd", k * U32 * np.abs(y) + y_bound, np.abs(w))
    return h_bound, out_bound + 2 * U32 * np.abs(out)


def path_length(cfg, t: int) -> int:
    """Reduction lengths summed over one path from the embeddings to the logits of a `t`-token
    forward: per block the norms (D), q/k/v projections (D), q/k norms and scores (Dh), softmax
    and attention-weighted sum over <= t keys, output projection (H Dh), router (D) and its softmax
    (E), expert projections (D, then F or the shared expert's width), the top-k combine (K), plus
    a few elementwise roundings; then the final norm and LM head (D each)."""
    d, dh = cfg.d_model, cfg.head_dim
    block = (
        5 * d
        + 2 * dh
        + 2 * t
        + cfg.n_heads * dh
        + cfg.n_experts
        + max(cfg.d_ff_expert, cfg.shared_expert_d_ff)
        + cfg.top_k
        + 4 * ELEMENTWISE
    )
    return cfg.n_layers * block + 2 * d


def _normed_dot_magnitude(norm_scale, w) -> np.ndarray:
    """sum_d |norm(x)_d| |w[d, j]| <= ||norm(x)||_2 ||w[:, j]||_2 <= sqrt(D) max|scale| ||w_j||,
    for any x (an RMSNorm output has ||x / rms(x)||_2 <= sqrt(D)): [J] for w [D, J]."""
    w = _f64(w)
    return np.sqrt(w.shape[0]) * np.abs(_f64(norm_scale)).max() * np.linalg.norm(w, axis=0)


def logits_bound(model, t: int) -> np.ndarray:
    """A bound [V] on |computed - exact| of the float32 logits of a `t`-token forward.

    The LM head's sum of |products| is at most sqrt(D) max|final norm scale| ||W[:, v]||_2 for any
    input; every reduction on the path is taken to cost its n u of that magnitude (an error
    relative to the hidden state carries through the norms and residual adds without growth).
    """
    cfg = model.cfg
    w = model.embed[...].T if model.lm_head is None else model.lm_head[...]
    mag = _normed_dot_magnitude(model.final_norm.scale[...], w)
    return path_length(cfg, t) * U32 * mag


def router_logits_bound(model, t: int) -> np.ndarray:
    """A bound [L] on |computed - exact| of each layer's float32 router logits (as `logits_bound`,
    with the router's magnitude after that layer's norm)."""
    mags = [
        _normed_dot_magnitude(block.mlp_norm.scale[...], block.moe.router[...]).max()
        for block in model.layers
    ]
    return path_length(model.cfg, t) * U32 * np.asarray(mags)


def decided(scores: np.ndarray, k: int, margin) -> np.ndarray:
    """Where the top-k of `scores [..., N]` (and its order) cannot change under errors of the
    scores below `margin / 2` each: every gap among the k + 1 largest exceeds `margin`.
    Returns bool [...]. `margin` broadcasts against [...]."""
    top = -np.sort(-_f64(scores), axis=-1)[..., : k + 1]
    return np.all(top[..., :-1] - top[..., 1:] > np.asarray(margin)[..., None], axis=-1)


def assert_logits_agree(model, got, want, t: int) -> None:
    """Two float32 computations of the logits [..., V] of `t`-token forwards differ by at most
    twice `logits_bound`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    bound = 2 * logits_bound(model, t)
    err = np.abs(got - want)
    worst = float(np.max(err / bound))
    assert worst <= 1, f"max |error| {err.max():.3g}: {worst:.3g} x the rounding bound"


def routing_decided(model, router_probs, t: int) -> np.ndarray:
    """bool [L, ...]: tokens whose top-k experts (and their order) two float32 computations of
    `t`-token forwards must agree on, from one computation's `router_probs [L, ..., E]`: the
    log-probability gaps (the router logits' gaps) exceed twice the two computations' difference,
    2 `router_logits_bound` per logit plus the softmax's rounding."""
    beta = router_logits_bound(model, t)
    margin = 4 * beta + 4 * ELEMENTWISE * U32
    logp = np.log(np.asarray(router_probs, np.float64))
    margin = margin.reshape((-1,) + (1,) * (logp.ndim - 2))
    return decided(logp, model.cfg.top_k, margin)
