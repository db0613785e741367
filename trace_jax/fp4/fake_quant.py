"""Fake quantization with a straight-through gradient (`jax.custom_vjp`).

Forward: `dequantize(quantize(x))` in `x.dtype`. Backward: the identity on `x` (straight-through
estimator); the PRNG key and the guidance get no cotangent. The only non-differentiable
arguments are hashable statics (format, rounding, global axes): arrays never go in
`nondiff_argnums`, so the rule works under jit, grad, vmap, scan, remat and shard_map.
"""

from __future__ import annotations

import functools

import jax

from trace_jax.fp4.formats import BlockFormat, get_format
from trace_jax.fp4.guidance import Guidance
from trace_jax.fp4.quantize import Rounding, dequantize, quantize


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fake_quant(x, key, guidance, fmt, rounding, global_axes):
    q = quantize(x, fmt, rounding=rounding, key=key, guidance=guidance, global_axes=global_axes)
    return dequantize(q, x.dtype)


def _fake_quant_fwd(x, key, guidance, fmt, rounding, global_axes):
    return _fake_quant(x, key, guidance, fmt, rounding, global_axes), None


def _fake_quant_bwd(fmt, rounding, global_axes, _, g):
    del fmt, rounding, global_axes
    return g, None, None


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fake_quant(
    x: jax.Array,
    fmt: str | BlockFormat,
    *,
    rounding: str | Rounding = "rtn",
    key: jax.Array | None = None,
    guidance: Guidance | None = None,
    global_axes: tuple[int, ...] | None = (-1,),
) -> jax.Array:
    """Quantize-dequantize `x [..., N]` in `fmt` (same shape and dtype), straight-through gradient.

    Arguments as in `quantize`.
    """
    fmt = get_format(fmt)
    rounding = Rounding(rounding)
    if global_axes is not None:
        global_axes = tuple(int(a) for a in global_axes)
    return _fake_quant(x, key, guidance, fmt, rounding, global_axes)
