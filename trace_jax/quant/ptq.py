"""Post-training NVFP4 weight quantization: the Table 7 baselines (SPEC section 7).

A BF16-trained policy's expert weights are quantized once after training, then evaluated with
FP4 execution (`QuantConfig(weights_prequantized=True)` keeps the weight sites from quantizing
them again). Three recipes, each a pure function of a weight tensor `w [..., N]` (blocks of 16
along the last, contraction axis) returning a `QTensor`:

  vanilla  RTN with the max-abs rule: `fp4.quantize(w, NVFP4, global_axes=...)`.
  4over6   (arXiv 2512.02010) global scale `amax / (6 * 256)`; per block two E4M3 scales, mapping
           the block max to 6 and to 4, and the one with the smaller squared error is kept (the
           256 leaves the "4" scale, 1.5x larger, room below E4M3's 448).
  hscale   (arXiv 2608.28113) per block the E4M3 scale in a window of `window` codes around the
           max-abs scale that minimizes `sum_j h_j (w_j - w_hat_j)**2`, where `h` is the diagonal
           of X^T X of calibration activations X (one weight per input channel j).

All candidates are quantized by the one quantizer (`fp4.quantize.quantize_core` with given scale
bits), so codes are RTN under each candidate scale and every result dequantizes with
`fp4.dequantize`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4
from trace_jax.fp4 import scales
from trace_jax.fp4.quantize import quantize_core

_FMT = fp4.NVFP4
_E4M3_MAX_BITS = 0x7E  # 448, the largest finite E4M3
RECIPES = ("vanilla", "4over6", "hscale")


def _blocks(x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // _FMT.block_size, _FMT.block_size)


def _candidate(x32, s_g, bits, weight):
    """(codes, per-block weighted squared error) of x quantized with the given scale bits."""
    codes, _, _ = quantize_core(x32, _FMT, s_g=s_g, scale_bits=bits)
    q = fp4.QTensor(codes, scales.from_bits(bits, _FMT), s_g, _FMT)
    err = (fp4.dequantize(q, jnp.float32) - x32) ** 2 * weight
    return codes, jnp.sum(_blocks(err), axis=-1)


def _best_of(x32, s_g, candidates, weight) -> fp4.QTensor:
    """Per block, the candidate scale bits with the smallest error (the first on ties)."""
    best_codes, best_err = _candidate(x32, s_g, candidates[0], weight)
    best_bits = candidates[0]
    for bits in candidates[1:]:
        codes, err = _candidate(x32, s_g, bits, weight)
        better = err < best_err
        best_bits = jnp.where(better, bits, best_bits)
        best_err = jnp.where(better, err, best_err)
        best_codes = jnp.where(jnp.repeat(better, _FMT.block_size, axis=-1), codes, best_codes)
    return fp4.QTensor(best_codes, scales.from_bits(best_bits, _FMT), s_g, _FMT)


def _global(x32, global_axes, denominator: float) -> jax.Array:
    """NVFP4 global scale `amax / denominator` over `global_axes` (the max-abs rule's edges)."""
    axes = scales.normalize_global_axes(global_axes, x32.ndim)
    s_g = scales.global_scale(x32, _FMT, axes)  # amax / (6 * 448), with its edge cases
    return s_g * np.float32(_FMT.elem.max_value * 448.0 / denominator)


def quantize_4over6(w: jax.Array, *, global_axes=(-1,)) -> fp4.QTensor:
    """4over6 NVFP4 quantization of `w [..., N]` (see the module docstring)."""
    x32 = jnp.asarray(w, jnp.float32)
    s_g = _global(x32, global_axes, 6.0 * 256.0)
    xb = _blocks(x32)
    to_six = scales.block_scale_bits(xb, _FMT, s_g)
    # amax / (4 s_g) = amax / (6 (s_g * 4 / 6)): the max-abs rule with a 2/3 global scale.
    to_four = scales.block_scale_bits(xb, _FMT, s_g * np.float32(4.0 / 6.0))
    return _best_of(x32, s_g, [to_six, to_four], jnp.ones((), jnp.float32))


def quantize_hscale(
    w: jax.Array, h: jax.Array, *, window: int = 3, global_axes=(-1,)
) -> fp4.QTensor:
    """H-Scale NVFP4 quantization of `w [..., N]` weighted by `h [N]` (or broadcastable to w).

    Candidates: the max-abs rule's E4M3 scale bits plus/minus up to `window` codes (positive
    E4M3 bit patterns are ordered like their values), kept within the finite positive range.
    """
    x32 = jnp.asarray(w, jnp.float32)
    s_g = _global(x32, global_axes, 6.0 * 448.0)
    base = scales.block_scale_bits(_blocks(x32), _FMT, s_g).astype(jnp.int32)
    finite = base != 0x7F
    candidates = [
        jnp.where(finite, jnp.clip(base + d, 1, _E4M3_MAX_BITS), base).astype(jnp.uint8)
        for d in [0, *(d for k in range(1, window + 1) for d in (-k, k))]
    ]
    weight = jnp.broadcast_to(jnp.asarray(h, jnp.float32), x32.shape)
    return _best_of(x32, s_g, candidates, weight)


def quantize_weights(
    w: jax.Array, recipe: str, *, h: jax.Array | None = None, global_axes=(-1,)
) -> fp4.QTensor:
    """One recipe of `RECIPES` on `w [..., N]` (`h` is required for "hscale")."""
    if recipe == "vanilla":
        return fp4.quantize(w, _FMT, global_axes=global_axes)
    if recipe == "4over6":
        return quantize_4over6(w, global_axes=global_axes)
    if recipe == "hscale":
        if h is None:
            raise ValueError("hscale needs the calibration statistics h (diag of X^T X)")
        return quantize_hscale(w, h, global_axes=global_axes)
    raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")


class _ExpertInputs:
    """A `QuantSite` that records the routed experts' inputs (and changes nothing)."""

    def __init__(self):
        self.inputs: dict[tuple[int, str], jax.Array] = {}

    def __call__(self, x, *, name, layer, experts=None):
        if name in ("expert_in", "expert_mid"):
            self.inputs[(layer, name)] = x
        return x


def calibration_stats(
    model, tokens: jax.Array, valid: jax.Array
) -> dict[int, dict[str, jax.Array]]:
    """H-Scale's `h`: per layer, the diagonal of X^T X of each expert's inputs.

    Runs the (bf16) model on calibration `tokens [B, T]` with `valid [B, T]` and returns
    `{layer: {"in": [E, D], "mid": [E, F]}}`: for expert e, the sum over the (token, slot) pairs
    routed to e of the squared expert input (for w_gate and w_up) and of the squared
    down-projection input (for w_down), float32.
    """
    recorder = _ExpertInputs()
    _, aux = model(tokens, mask=valid, site=recorder)
    n_experts = model.cfg.n_experts
    stats = {}
    for layer in range(model.cfg.n_layers):
        routed = jax.nn.one_hot(aux["topk_idx"][layer], n_experts, dtype=jnp.float32)
        routed = routed * valid[..., None, None]  # [B, T, K, E]
        x = recorder.inputs[(layer, "expert_in")].astype(jnp.float32)  # [B, T, D]
        h = recorder.inputs[(layer, "expert_mid")].astype(jnp.float32)  # [B, T, K, F]
        stats[layer] = {
            "in": jnp.einsum("btke,btd->ed", routed, x * x),
            "mid": jnp.einsum("btke,btkf->ef", routed, h * h),
        }
    return stats


def quantize_model_experts(model, recipe: str, stats=None) -> dict[str, float]:
    """Replaces every routed-expert weight of `model` (in place) by its `recipe` NVFP4 values.

    Weights are quantized as the weight sites see them (cast to the compute dtype, one global
    scale per expert); `stats` from `calibration_stats` weight the H-Scale search (w_gate, w_up
    by the "in" statistics, w_down by "mid"). Evaluate the result with
    `QuantConfig(weights_prequantized=True)`. Returns the summed squared error per weight name.
    """
    errors = {"w_gate": 0.0, "w_up": 0.0, "w_down": 0.0}
    for layer, block in enumerate(model.layers):
        moe = block.moe
        for name, key in (("w_gate", "in"), ("w_up", "in"), ("w_down", "mid")):
            param = getattr(moe, name)
            w = param[...].astype(model.cfg.dtype)
            h = None if stats is None else stats[layer][key][:, None, :]  # [E, 1, K]
            q = quantize_weights(w, recipe, h=h, global_axes=(-2, -1))
            errors[name] += float(weighted_error(w, q))
            param[...] = fp4.dequantize(q, jnp.float32).astype(param[...].dtype)
    return errors


def weighted_error(w: jax.Array, q: fp4.QTensor, h: jax.Array | None = None) -> jax.Array:
    """`sum h_j (w - dequantize(q))**2` over all elements (h = 1 when None), float32."""
    err = (fp4.dequantize(q, jnp.float32) - jnp.asarray(w, jnp.float32)) ** 2
    if h is not None:
        err = err * jnp.broadcast_to(jnp.asarray(h, jnp.float32), err.shape)
    return jnp.sum(err)


__all__ = [
    "RECIPES",
    "calibration_stats",
    "quantize_4over6",
    "quantize_hscale",
    "quantize_model_experts",
    "quantize_weights",
    "weighted_error",
]
