"""Rounding-error bounds of decode attention, for comparing a kernel with its reference.

A kernel and its reference sum in different orders (split-K partials, blocks, an online softmax),
so they agree only to rounding. The bound follows the standard rule for a sum or dot of n terms in
float32, in any order, |fl(sum) - sum| <= n u sum|terms| (u = 2**-24, first order), through the
softmax, in float64 numpy; it never depends on an observed error.

Axis legend: B batch, H query heads, Hkv kv heads, G = H // Hkv, S cache slots, Dh head dim.
"""

from __future__ import annotations

import numpy as np

U32 = 2.0**-24  # float32 unit roundoff
U_BF16 = 2.0**-8  # bfloat16 unit roundoff
# A few elementwise float32 roundings (exp within a few ulps, 1 ulp <= 2 u; the products by the
# softmax scale, the row factors and the rescales), in units of u.
ELEMENTWISE = 8


def _softmax_weights(q, k, v, lengths):
    """float64 (P [B, H, S] the softmax, 0 at invalid slots; the exponents s_j - max s; the scores'
    sums of magnitudes scale sum_i |q_i k_ji| [B, H, S]; v per query head [B, S, H, Dh], 0 at
    invalid slots; valid [B, S])."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    h, dh = q.shape[1:]
    s, hkv = k.shape[1:3]
    valid = np.arange(s)[None, :] < np.asarray(lengths)[:, None]  # [B, S]
    k, v = (np.where(valid[:, :, None, None], a, 0.0).repeat(h // hkv, axis=2) for a in (k, v))
    scale = dh**-0.5
    scores = np.where(valid[:, None, :], scale * np.einsum("bhd,bshd->bhs", q, k), -np.inf)
    mag = scale * np.einsum("bhd,bshd->bhs", np.abs(q), np.abs(k))
    # A query cast to float16 (the "f16" decode) may lose up to u max|q| per element (subnormals).
    mag += scale * np.abs(q).max(-1)[..., None] * np.abs(k).sum(-1).transpose(0, 2, 1)
    with np.errstate(invalid="ignore"):  # rows with no valid slot: NaN
        shifted = np.where(valid[:, None, :], scores - scores.max(-1, keepdims=True), 0.0)
        p = np.where(valid[:, None, :], np.exp(shifted), 0.0)
        p = p / p.sum(-1, keepdims=True)
    return p, shifted, mag, v, valid


def pv_magnitude(q, k, v, lengths) -> np.ndarray:
    """sum_j P_j |v_jd| [B, H, Dh] float64: the scale of the p . v dot's rounding."""
    p, _, _, v, _ = _softmax_weights(q, k, v, lengths)
    return np.einsum("bhs,bshd->bhd", p, np.abs(v))


def attention_error_bound(q, k, v, lengths, *, steps: int, p_unit: float = 0.0):
    """(out [B, H, Dh], bound [B, H, Dh]) float64: exact decode attention and a bound on
    |computed - exact| of one float32 computation of it.

    q [B, H, Dh]; k, v [B, S, Hkv, Dh] the cached values as the reference reads them (stale slots
    may hold anything); lengths [B]. `steps`: how many times a probability can be rescaled
    (online-softmax blocks plus the split combine). `p_unit`: the unit roundoff of the
    probabilities' dtype in the p . v dot (0 for float32).

    With s_j the scores (scale * q . k_j) and P_j the softmax: the dot gives |ds_j| <= (Dh + 4) u
    scale sum_i |q_i k_ji| (the 4: the scale, row factors, the dequantized K's own rounding; plus
    u scale max|q| sum_i |k_ji| for a query cast to float16), the exponent's subtraction and the
    rescales a relative error e_j <= |ds_j| + u |s_j - max s| + ELEMENTWISE u steps on p_j, which
    moves the normalized output by sum_j P_j e_j |v_j - out|; the sums over the n valid slots add
    n u (sum_j P_j |v_j| + |out|), the probabilities' own rounding p_unit sum_j P_j |v_j|.
    Rows with lengths 0 come back NaN.
    """
    p, shifted, mag, v, valid = _softmax_weights(q, k, v, lengths)
    dh = np.shape(q)[-1]
    out = np.einsum("bhs,bshd->bhd", p, v)
    rel = (dh + 4) * U32 * mag + U32 * np.abs(shifted) + ELEMENTWISE * U32 * steps
    spread = np.abs(v.transpose(0, 2, 1, 3) - out[:, :, None, :])  # |v_j - out| [B, H, S, Dh]
    moved = np.einsum("bhs,bhsd->bhd", p * rel, spread)
    pv_mag = np.einsum("bhs,bshd->bhd", p, np.abs(v))
    n = valid.sum(-1)[:, None, None] + ELEMENTWISE
    return out, moved + (n * U32 + p_unit) * pv_mag + n * U32 * np.abs(out)


def kernel_tolerance(q, k, v, lengths, out, ref, *, bf16: bool) -> np.ndarray:
    """The bound [B, H, Dh] on |out - ref| for a decode-attention kernel's output `out` against
    its reference's `ref`, each within `attention_error_bound` of exact (probabilities rescaled
    once per block of at least 16 slots and once by the split combine). With a bf16 query (`bf16`)
    also the kernel's bf16 (or float16) probabilities in the p . v dot, 2**-8 of each term
    (float16 subnormals below 2**-14 lose at most 2**-25 each, far less), and both outputs'
    rounding to bf16, 2**-8 of each. k, v [B, S, Hkv, Dh] as the reference reads them."""
    steps = -(-np.shape(k)[1] // 16) + 1
    _, one = attention_error_bound(q, k, v, lengths, steps=steps)
    if not bf16:
        return 2 * one
    out, ref = (np.abs(np.asarray(a, np.float64)) for a in (out, ref))
    return 2 * one + U_BF16 * (pv_magnitude(q, k, v, lengths) + out + ref)


def assert_within(got, want, bound) -> None:
    """|got - want| <= bound elementwise (float64); the message says how far beyond it."""
    got, want = (np.asarray(a, np.float64) for a in (got, want))
    assert got.shape == want.shape, (got.shape, want.shape)
    err, bound = np.abs(got - want), np.broadcast_to(bound, got.shape)
    over = ~(err <= bound)  # NaN counts as over
    assert not over.any(), (
        f"{over.sum()} of {err.size} beyond the rounding bound, up to "
        f"{np.max(err[over] / bound[over]):.3g} x it (|error| {err[over].max():.3g})"
    )
