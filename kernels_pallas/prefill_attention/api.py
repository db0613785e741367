"""`prefill_attention`: the op's one public interface; tries implementations in order, moving on
at NotImplementedError, the XLA reference last.

Implementations (`kernels_pallas.common.Implementation`): "pallas", the flash attention of
`kernel.py` through Triton (an NVIDIA GPU, or interpret=True; NotImplementedError for a head_dim
that is no power of two >= 16) or of `mosaic.py` through Mosaic (a TPU, or interpret=
`pltpu.InterpretParams()`), and "xla", `reference.prefill_attention_reference` (jitted). The
default (`implementation=None`) is ("pallas", "xla") where Pallas compiles natively and the
reference alone elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import common
from kernels_pallas.common import Implementation, ImplementationLike, Interpret
from kernels_pallas.prefill_attention import kernel, mosaic, reference

reference_jit = jax.jit(reference.prefill_attention_reference)


def block_config(
    rows: int,
    slots: int,
    *,
    block_r: int | None = None,
    block_s: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> kernel.BlockConfig:
    """The given tiles and launch parameters, the rest from `kernel.default_block_config`."""
    default = kernel.default_block_config(rows, slots)
    given = dict(block_r=block_r, block_s=block_s, num_warps=num_warps, num_stages=num_stages)
    return kernel.BlockConfig(
        **{f: getattr(default, f) if value is None else value for f, value in given.items()}
    )


def prefill_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    kv_lengths: jax.Array,
    *,
    implementation: ImplementationLike = None,
    block_r: int | None = None,
    block_s: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: Interpret = None,
) -> jax.Array:
    """Causal attention of a prefill chunk over the KV cache.

    Args:
      q: `[B, T, Hkv, G, Dh]` bfloat16 or float32, the chunk's queries (G per kv head).
      k, v: `[B, S, Hkv, Dh]` in q's dtype, the cache after the chunk's keys were written.
      positions: int32 `[B, T]`, each query's cache slot; it sees slots `s <= positions[b, t]`
        with `s < kv_lengths[b]`.
      kv_lengths: int32 `[B]`, valid slots per row (clipped to S).
      implementation: None | "pallas" | "xla", or a sequence of them (module docstring).
      block_r, block_s, num_warps, num_stages: the Pallas tiling (`kernel.BlockConfig`; None:
        `kernel.default_block_config`); through Mosaic block_r and block_s only
        (`mosaic.mosaic_tiling`: multiples of 16 rows and 128 slots).
      interpret: None (native, or the `common.interpreting` context's choice), True (the Triton
        kernel interpreted) or `pltpu.InterpretParams` (the Mosaic kernel interpreted); see
        `common.pallas_target`.

    Returns `[B, T, Hkv, G, Dh]` in q's dtype, float32 scores and softmax. A query that sees no
    slot (kv_lengths 0) gives zeros from the kernel and the mean of V from the reference.
    """
    _, t, _, g, dh, s = reference.check_operands(q, k, v, positions, kv_lengths)
    tiles = dict(block_r=block_r, block_s=block_s, num_warps=num_warps, num_stages=num_stages)

    def run_pallas():
        target = common.pallas_target(interpret)
        if target.lowering is common.Lowering.MOSAIC:
            tiling = mosaic.mosaic_tiling(t * g, s, block_r, block_s)
            call = functools.partial(
                mosaic.prefill_attention_mosaic, tiling=tiling, interpret=target.interpret
            )  # rows are independent: on a mesh, each device attends its own
            return common.per_device(call, q, k, v, positions, kv_lengths, split_leading=True)
        if dh < kernel.MIN_BLOCK or dh & (dh - 1):
            raise NotImplementedError(f"the Triton kernel needs a power-of-two head_dim, got {dh}")
        config = block_config(t * g, s, **tiles)
        call = functools.partial(
            kernel.prefill_attention_pallas, config=config, interpret=target.interpret
        )  # as above: GSPMD cannot partition a Triton call either
        return common.per_device(call, q, k, v, positions, kv_lengths, split_leading=True)

    def run_xla():
        return reference_jit(q, k, v, positions, jnp.minimum(kv_lengths, s))

    runners = {Implementation.PALLAS: run_pallas, Implementation.XLA: run_xla}
    return common.run_first(common.implementation_order(implementation), runners)[0]
