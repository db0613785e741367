"""Decode attention over a packed FP4 (or bf16) KV cache: the ops' one public interface.

`fp4_decode_attention(q, k_cache, v_cache, lengths)` attends one new query token per sequence to
the slots `< lengths[b]` of a `PackedTensorCache` pair; `bf16_decode_attention` is its twin over a
bf16 cache. `implementation=` (`kernels_pallas.common`): "pallas", "xla" (the float32 reference),
None (Pallas where it compiles natively and takes the shapes, else the reference), or a sequence
of them. The Pallas kernel (`common.pallas_target`): `kernel.py`'s through Triton (an NVIDIA GPU,
or interpret=True; NotImplementedError natively where the shapes do not fit Triton), or, for the
FP4 op, `mosaic.fp4_decode_attention_mosaic` through Mosaic (a TPU, or interpret=
`pltpu.InterpretParams()`; it refuses shapes it cannot take with NotImplementedError when called,
and the plan's `then` runs instead). The bf16 twin has no Mosaic kernel: on a TPU its XLA
reference runs. `*_plan(...)` takes the same arguments and returns the `DecodePlan` the call
runs: which implementation and lowering, the tiling, and why a preferred one was skipped.

Axis legend: B batch, H query heads, Hkv kv heads, G = H // Hkv, S cache slots, Dh head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import common
from kernels_pallas.common import Implementation, ImplementationLike, Interpret, Lowering
from kernels_pallas.fp4_decode_attention import kernel, reference
from trace_jax.fp4 import PackedTensorCache

# Default tiling per kernel, from the H200 launch sweep (kernels_decode_attention.md): the FP4
# kernel is bound by its arithmetic and load latency and gains from more resident programs (8 per
# SM, 128-slot steps: 1.49 -> 1.27 ms at 128K); the bf16 twin streams at the read ceiling with 2
# per SM.
DEFAULT_BLOCK_S = 64  # bf16 twin
FP4_DEFAULT_BLOCK_S = 128
# Three load stages from 32K slots on: 1-13% faster than two at 32K-128K in two H200 sweeps,
# while at 4K-8K the two sweeps disagreed (-7% to +11%), so shorter caches keep BlockConfig's
# two, as does the bf16 twin.
FP4_LONG_CONTEXT_SLOTS = 32768
FP4_LONG_CONTEXT_NUM_STAGES = 3
# p . v accumulated transposed from head_dim 128 on, with the "f16" decode: 3-11% faster at
# 32K-128K for G = 4 and 8 with head_dim 128 on the H200, 2.3-2.7x slower with head_dim 64, and
# the "e4m3" decode 36-48% slower with it.
FP4_PV_TRANSPOSED_MIN_HEAD_DIM = 128
# Streaming multiprocessors of an H100/H200; the default k_splits aims at programs per SM.
NUM_SMS = 132
TARGET_PROGRAMS = 2 * NUM_SMS  # bf16 twin
FP4_TARGET_PROGRAMS = 8 * NUM_SMS
_Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# The "xla" implementation: the references, jitted (eager calls would dispatch every op separately).
fp4_reference_jit = jax.jit(reference.fp4_decode_attention_reference)
bf16_reference_jit = jax.jit(reference.bf16_decode_attention_reference)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """What one call runs.

    Attributes:
      implementation: Implementation.PALLAS or Implementation.XLA.
      interpret: what the kernel's `interpret=` gets (`common.PallasTarget.interpret`: False
        for native Triton, True for the generic interpreter, None for native Mosaic,
        `pltpu.InterpretParams` for the TPU interpreter); None for XLA.
      config: the kernel's tiling (also filled in for XLA, which ignores it; the Mosaic kernel
        reads its block_s, by default `mosaic.DEFAULT_BLOCK_S`).
      k_splits: number of splits of the S slots (grid axis 2).
      fallback: why an earlier implementation of the order was skipped (Pallas where it does
        not compile, Triton for shapes it cannot take, no Mosaic kernel), else None.
      lowering: Lowering.TRITON or Lowering.MOSAIC for PALLAS; None for XLA.
      then: the implementations tried after this one if its kernel refuses the shapes when
        called (the Mosaic kernel checks its own).
    """

    implementation: Implementation
    interpret: bool | pltpu.InterpretParams | None
    config: kernel.BlockConfig
    k_splits: int
    fallback: str | None = None
    lowering: Lowering | None = None
    then: tuple[Implementation, ...] = ()


def default_k_splits(
    batch: int, kv_heads: int, slots: int, block_s: int, target: int = TARGET_PROGRAMS
) -> int:
    """Splits so that B * Hkv * k_splits reaches `target` programs, at most one per block of S."""
    want = pl.cdiv(target, batch * kv_heads)
    return max(1, min(want, pl.cdiv(slots, block_s)))


def _triton_unsupported(head_dim: int, block_size: int | None) -> str | None:
    """Why the native Triton lowering cannot run these shapes (power-of-two tensors), or None."""
    if head_dim < 32 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 32 (Triton tensors)"
    if block_size is not None and block_size & (block_size - 1):
        return f"scale block {block_size} is not a power of two (Triton tensors)"
    return None


def _check_q_lengths(q, lengths, batch: int, kv_heads: int, head_dim: int, what: str) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, Dh], got shape {q.shape}")
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"q must be bfloat16 or float32, got {q.dtype}")
    b, h, dh = q.shape
    if b != batch:
        raise ValueError(f"q has batch {b} but the {what} has batch {batch}")
    if dh != head_dim:
        raise ValueError(f"q has head_dim {dh} but the {what} has head_dim {head_dim}")
    if h % kv_heads:
        raise ValueError(f"q's {h} heads are not a multiple of the {what}'s {kv_heads} kv heads")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape ({batch},), got {lengths.shape}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integers, got {lengths.dtype}")


def _plan(
    q,
    slots: int,
    kv_heads: int,
    block_size: int | None,
    *,
    implementation,
    k_splits,
    block_s,
    interpret,
    decode=None,
    num_warps=None,
    num_stages=None,
    pv_transposed=None,
    default_block_s=DEFAULT_BLOCK_S,
    default_num_stages=None,
    default_pv_transposed=None,
    target_programs=TARGET_PROGRAMS,
    has_mosaic=True,
) -> DecodePlan:
    order = common.implementation_order(implementation)
    chosen, fallback, target, then = None, None, None, ()
    for i, impl in enumerate(order):
        reason = None
        if impl is Implementation.PALLAS:
            try:
                target = common.pallas_target(interpret)
            except common.PallasUnavailableError as e:
                if i == len(order) - 1:
                    raise
                reason = str(e)
        if reason is None and impl is Implementation.PALLAS:
            if target.lowering is Lowering.MOSAIC and not has_mosaic:
                reason = "the bf16 twin has no Mosaic kernel (its XLA reference runs on a TPU)"
            elif target.lowering is Lowering.TRITON and not target.interpreted:
                reason = _triton_unsupported(q.shape[-1], block_size)
        if reason is None:
            chosen, then = impl, order[i + 1 :]
            break
        if i == len(order) - 1:
            raise NotImplementedError(f"the Pallas decode-attention kernel: {reason}")
        fallback = reason
    if chosen is Implementation.PALLAS and target.lowering is Lowering.MOSAIC:
        # The Mosaic kernel's own defaults (`mosaic.py`): a TPU core walks its grid in sequence.
        from kernels_pallas.fp4_decode_attention import mosaic

        default_block_s = mosaic.DEFAULT_BLOCK_S
        if k_splits is None:
            k_splits = mosaic.default_k_splits(q.shape[0], kv_heads)

    if slots < 1:
        raise ValueError("the cache has no slots (S = 0)")
    block_s = default_block_s if block_s is None else block_s
    num_stages = default_num_stages if num_stages is None else num_stages
    pv_transposed = default_pv_transposed if pv_transposed is None else pv_transposed
    if pv_transposed is not None and not isinstance(pv_transposed, bool):
        raise ValueError(f"pv_transposed must be a bool or None, got {pv_transposed!r}")
    if not isinstance(block_s, int) or block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of two >= 16, got {block_s!r}")
    n_blocks = pl.cdiv(slots, block_s)
    if k_splits is None:
        k_splits = default_k_splits(q.shape[0], kv_heads, slots, block_s, target_programs)
    if not isinstance(k_splits, int) or k_splits < 1:
        raise ValueError(f"k_splits must be a positive int, got {k_splits!r}")
    chunk = pl.cdiv(n_blocks, min(k_splits, n_blocks)) * block_s
    config = kernel.BlockConfig(
        block_s=block_s,
        chunk=chunk,
        block_g=kernel.block_g_for(q.shape[1] // kv_heads),
        decode=kernel.DEFAULT_DECODE if decode is None else decode,
        **({} if num_warps is None else {"num_warps": num_warps}),
        **({} if num_stages is None else {"num_stages": num_stages}),
        **({} if pv_transposed is None else {"pv_transposed": pv_transposed}),
    )
    pallas = chosen is Implementation.PALLAS
    return DecodePlan(
        implementation=chosen,
        interpret=target.interpret if pallas else None,
        config=config,
        k_splits=config.k_splits(slots),
        fallback=fallback,
        lowering=target.lowering if pallas else None,
        then=then,
    )


def fp4_decode_attention_plan(
    q: jax.Array,
    k_cache: PackedTensorCache,
    v_cache: PackedTensorCache,
    lengths: jax.Array,
    *,
    implementation: ImplementationLike = None,
    k_splits: int | None = None,
    block_s: int | None = None,
    interpret: Interpret = None,
    decode: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pv_transposed: bool | None = None,
) -> DecodePlan:
    """Checks the arguments of `fp4_decode_attention` and returns the plan it runs."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, PackedTensorCache):
            raise ValueError(f"{name} must be a PackedTensorCache, got {type(cache).__name__}")
        if cache.codes.ndim != 4 or cache.codes.dtype != jnp.uint8:
            raise ValueError(
                f"{name}.codes must be uint8 [B, Hkv, S, Dh // 2], got {cache.codes.dtype} "
                f"{cache.codes.shape}"
            )
        fmt = cache.fmt
        if not fmt.is_fp4:
            raise ValueError(f"{name} must hold an FP4 format, got {fmt.name}")
        shape = cache.shape
        rows = cache.codes.shape[:3]  # head-major [B, Hkv, S]
        nb_shape = (*rows, shape[3] // fmt.block_size)
        if shape[3] % fmt.block_size or cache.scales.shape != nb_shape:
            raise ValueError(
                f"{name}.scales must be [B, Hkv, S, Dh // {fmt.block_size}] = {nb_shape} "
                f"for {fmt.name}, got {cache.scales.shape}"
            )
        if cache.scales.dtype != fmt.scale_dtype:
            raise ValueError(
                f"{name}.scales must be {fmt.scale_dtype} for {fmt.name}, got {cache.scales.dtype}"
            )
        if fmt.has_global_scale and (
            cache.global_scale is None or cache.global_scale.shape != (*rows, 1)
        ):
            got = None if cache.global_scale is None else cache.global_scale.shape
            raise ValueError(f"{name}.global_scale must be [B, Hkv, S, 1], got {got}")
    if k_cache.fmt != v_cache.fmt or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache ({k_cache.fmt.name} {k_cache.shape}) and v_cache ({v_cache.fmt.name} "
            f"{v_cache.shape}) must have the same format and shape"
        )
    batch, slots, kv_heads, head_dim = k_cache.shape
    _check_q_lengths(q, lengths, batch, kv_heads, head_dim, "cache")
    return _plan(
        q,
        slots,
        kv_heads,
        k_cache.fmt.block_size,
        implementation=implementation,
        k_splits=k_splits,
        block_s=block_s,
        interpret=interpret,
        decode=decode,
        num_warps=num_warps,
        num_stages=num_stages,
        pv_transposed=pv_transposed,
        default_block_s=FP4_DEFAULT_BLOCK_S,
        default_num_stages=FP4_LONG_CONTEXT_NUM_STAGES if slots >= FP4_LONG_CONTEXT_SLOTS else None,
        default_pv_transposed=(
            head_dim >= FP4_PV_TRANSPOSED_MIN_HEAD_DIM
            and (decode or kernel.DEFAULT_DECODE) == "f16"
        ),
        target_programs=FP4_TARGET_PROGRAMS,
    )


def fp4_decode_attention(
    q: jax.Array,
    k_cache: PackedTensorCache,
    v_cache: PackedTensorCache,
    lengths: jax.Array,
    *,
    implementation: ImplementationLike = None,
    k_splits: int | None = None,
    block_s: int | None = None,
    interpret: Interpret = None,
    decode: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pv_transposed: bool | None = None,
) -> jax.Array:
    """Attention of one new query token per sequence over a packed FP4 KV cache.

    Args:
      q: [B, H, Dh] bfloat16 or float32; query head h reads kv head h // (H // Hkv).
      k_cache, v_cache: `PackedTensorCache`s of one format (NVFP4 or MXFP4), [B, S, Hkv, Dh].
      lengths: int [B]; slots < lengths[b] are attended (at least 1; 0 gives NaN). Values above S
        count as S.
      implementation: None | "pallas" | "xla" or a sequence of them (see the module docstring).
      k_splits: splits of the S slots (default: `default_k_splits`; Mosaic:
        `mosaic.default_k_splits`); the effective number is
        `fp4_decode_attention_plan(...).k_splits` (no split is left empty).
      block_s: slots per kernel step, a power of two >= 16 (default FP4_DEFAULT_BLOCK_S; Mosaic:
        a power of two >= 128, default `mosaic.DEFAULT_BLOCK_S`).
      interpret: None (native, or the `common.interpreting` context's choice), True (the Triton
        kernel interpreted) or `pltpu.InterpretParams` (the Mosaic kernel interpreted); see
        `common.pallas_target`.
      decode: the kernel's FP4 decode, "f16" or "e4m3" (see `kernel.BlockConfig`; default
        `kernel.DEFAULT_DECODE`).
      num_warps, num_stages: Triton launch parameters (defaults `kernel.BlockConfig`'s).
      pv_transposed: accumulate p . v transposed (`kernel.BlockConfig.pv_transposed`; default:
        from head_dim FP4_PV_TRANSPOSED_MIN_HEAD_DIM on with the "f16" decode).

    Returns:
      [B, H, Dh] in q.dtype: softmax(q k^T * Dh**-0.5) v over the valid slots.
    """
    lengths = jnp.asarray(lengths)
    plan = fp4_decode_attention_plan(
        q,
        k_cache,
        v_cache,
        lengths,
        implementation=implementation,
        k_splits=k_splits,
        block_s=block_s,
        interpret=interpret,
        decode=decode,
        num_warps=num_warps,
        num_stages=num_stages,
        pv_transposed=pv_transposed,
    )
    if plan.implementation is Implementation.XLA:
        return fp4_reference_jit(q, k_cache, v_cache, lengths)
    if plan.lowering is Lowering.TRITON:
        attend = functools.partial(
            kernel.fp4_decode_attention_pallas, config=plan.config, interpret=plan.interpret
        )  # sequences are independent, as for Mosaic below
        return common.per_device(attend, q, k_cache, v_cache, lengths, split_leading=True)

    def run_mosaic():
        from kernels_pallas.fp4_decode_attention.mosaic import fp4_decode_attention_mosaic

        def attend(q, k_cache, v_cache, lengths):
            return fp4_decode_attention_mosaic(
                q,
                k_cache,
                v_cache,
                lengths,
                block_s=plan.config.block_s,
                k_splits=plan.k_splits,
                interpret=plan.interpret,
            )

        # Sequences are independent: a mesh splits them over its devices.
        return common.per_device(attend, q, k_cache, v_cache, lengths, split_leading=True)

    runners = {
        Implementation.PALLAS: run_mosaic,
        Implementation.XLA: lambda: fp4_reference_jit(q, k_cache, v_cache, lengths),
    }
    return common.run_first((Implementation.PALLAS, *plan.then), runners)[0]


def bf16_decode_attention_plan(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    implementation: ImplementationLike = None,
    k_splits: int | None = None,
    block_s: int | None = None,
    interpret: Interpret = None,
) -> DecodePlan:
    """Checks the arguments of `bf16_decode_attention` and returns the plan it runs."""
    for name, a in (("k", k), ("v", v)):
        if a.ndim != 4 or a.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16 [B, S, Hkv, Dh], got {a.dtype} {a.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    batch, slots, kv_heads, head_dim = k.shape
    _check_q_lengths(q, lengths, batch, kv_heads, head_dim, "bf16 cache")
    return _plan(
        q,
        slots,
        kv_heads,
        None,
        implementation=implementation,
        k_splits=k_splits,
        block_s=block_s,
        interpret=interpret,
        has_mosaic=False,
    )


def bf16_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    implementation: ImplementationLike = None,
    k_splits: int | None = None,
    block_s: int | None = None,
    interpret: Interpret = None,
) -> jax.Array:
    """`fp4_decode_attention`'s twin over a bf16 cache k, v [B, S, Hkv, Dh] (same arguments)."""
    lengths = jnp.asarray(lengths)
    plan = bf16_decode_attention_plan(
        q,
        k,
        v,
        lengths,
        implementation=implementation,
        k_splits=k_splits,
        block_s=block_s,
        interpret=interpret,
    )
    if plan.implementation is Implementation.XLA:
        return bf16_reference_jit(q, k, v, lengths)
    attend = functools.partial(
        kernel.bf16_decode_attention_pallas, config=plan.config, interpret=plan.interpret
    )  # sequences are independent: on a mesh each device attends its own (`common.per_device`)
    return common.per_device(attend, q, k, v, lengths, split_leading=True)
