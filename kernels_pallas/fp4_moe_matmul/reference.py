"""The op's data types, argument checks and float32 XLA reference (every implementation's base).

Axis legend: M rows of lhs (token-slot assignments sorted by group), K contraction, N outputs,
G groups (experts). Contract: `jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`,
with the weights stored `[G, N, K]` (contraction last, like the model's `[E, F, D]`); rows of lhs
are grouped contiguously by expert and rows past `sum(group_sizes)` give 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trace_jax import fp4
from trace_jax.fp4.qtensor import validate_layout

Lhs = jax.Array | fp4.QTensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedFP4Weights:
    """Grouped FP4 weights `[G, N, K]`, quantized in blocks along K and packed two codes per byte.

    Invariants (checked by `validate`):
      codes: uint8 `[G, N, K // 2]`: E2M1 codes, element 2i in the low nibble (`fp4.pack_fp4`).
      scales: `[G, N, K // fmt.block_size]` in `fmt.scale_dtype`.
      global_scale: float32 `[G, 1, 1]`, one per expert (NVFP4), else None (MXFP4).
      fmt: an FP4 `BlockFormat` (`fp4.NVFP4` or `fp4.MXFP4`), static.
    """

    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array | None
    fmt: fp4.BlockFormat = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        """The unpacked weight shape `(G, N, K)`."""
        g, n, half_k = self.codes.shape
        return g, n, 2 * half_k

    def validate(self) -> PackedFP4Weights:
        """Raises ValueError if the arrays break the invariants above; returns self."""
        if not self.fmt.is_fp4:
            raise ValueError(f"PackedFP4Weights needs an FP4 (E2M1) format, got {self.fmt.name}")
        if self.codes.ndim != 3:
            raise ValueError(
                f"PackedFP4Weights.codes must be [G, N, K // 2], got shape {self.codes.shape}"
            )
        if self.codes.dtype != jnp.uint8:
            raise ValueError(f"PackedFP4Weights.codes must be uint8, got {self.codes.dtype}")
        validate_layout(
            self.shape, self.fmt, self.scales, self.global_scale, what="PackedFP4Weights"
        )
        if self.global_scale is not None:
            expected = (self.shape[0], 1, 1)
            if tuple(self.global_scale.shape) != expected:
                raise ValueError(
                    "PackedFP4Weights.global_scale must hold one value per expert, shape "
                    f"{expected}; got {tuple(self.global_scale.shape)}"
                )
            if self.global_scale.dtype != jnp.float32:
                raise ValueError(
                    f"PackedFP4Weights.global_scale must be float32, got {self.global_scale.dtype}"
                )
        return self

    def unpacked(self) -> fp4.QTensor:
        """The weights as a `QTensor` `[G, N, K]` (one code per byte)."""
        return fp4.QTensor(
            codes=fp4.unpack_fp4(self.codes),
            scales=self.scales,
            global_scale=self.global_scale,
            fmt=self.fmt,
        )


def pack_weights(w: jax.Array, fmt: str | fp4.BlockFormat) -> PackedFP4Weights:
    """Quantizes float weights `w [G, N, K]` (RTN) with one global scale per expert and packs them.

    Args:
      w: floating `[G, N, K]`, K a multiple of the format's block size (and even).
      fmt: `fp4.NVFP4` or `fp4.MXFP4` (or their names).
    """
    fmt = fp4.get_format(fmt)
    if not fmt.is_fp4:
        raise ValueError(f"pack_weights packs FP4 (E2M1) weights, got format {fmt.name}")
    if w.ndim != 3:
        raise ValueError(f"pack_weights expects weights [G, N, K], got shape {w.shape}")
    q = fp4.quantize(w, fmt, global_axes=(-2, -1))
    return PackedFP4Weights(
        codes=fp4.pack_fp4(q.codes), scales=q.scales, global_scale=q.global_scale, fmt=fmt
    ).validate()


def check_operands(lhs: Lhs, rhs: PackedFP4Weights, group_sizes: jax.Array):
    """Validates the operands (shapes and dtypes only); returns `(M, K, N, G)`.

    Raises:
      TypeError: rhs is not a `PackedFP4Weights`.
      ValueError: wrong ranks or dtypes, K mismatch, group_sizes not int32 `[G]`, a K that is not
        a multiple of a format's block size.
    """
    if not isinstance(rhs, PackedFP4Weights):
        raise TypeError(f"rhs must be a PackedFP4Weights (see pack_weights), got {type(rhs)}")
    rhs.validate()
    g, n, k_rhs = rhs.shape
    if isinstance(lhs, fp4.QTensor):
        if lhs.codes.ndim != 2:
            raise ValueError(f"lhs must be [M, K], got a QTensor of shape {lhs.shape}")
        lhs.validate()
    else:
        lhs = jnp.asarray(lhs)
        if lhs.ndim != 2:
            raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
        if lhs.dtype != jnp.bfloat16:
            raise ValueError(f"a plain lhs must be bfloat16 (or pass a QTensor), got {lhs.dtype}")
    m, k = lhs.shape
    if k != k_rhs:
        raise ValueError(
            f"contraction mismatch: lhs [M, K] = {tuple(lhs.shape)} but rhs [G, N, K] = "
            f"{(g, n, k_rhs)}"
        )
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (g,):
        raise ValueError(
            f"group_sizes must have shape (G,) = ({g},) to match rhs, got {group_sizes.shape}"
        )
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32, got {group_sizes.dtype}")
    return m, k, n, g


def dequantize_lhs(lhs: Lhs) -> jax.Array:
    """float32 `[M, K]` values of the activations."""
    if isinstance(lhs, fp4.QTensor):
        return fp4.dequantize(lhs, jnp.float32)
    return jnp.asarray(lhs).astype(jnp.float32)


def dequantize_weights(rhs: PackedFP4Weights) -> jax.Array:
    """float32 `[G, N, K]` values of the packed weights."""
    return fp4.dequantize(rhs.unpacked(), jnp.float32)


def fp4_moe_matmul_reference(
    lhs: Lhs,
    rhs: PackedFP4Weights,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """`ragged_dot(lhs, rhs^T)` on dequantized float32 operands at HIGHEST precision -> `[M, N]`.

    Caveat: XLA's CPU ragged_dot computes masked dense products, so a NaN/Inf in one expert's
    weights leaks into every row of the affected output columns (other groups and rows past the
    sum included); the Pallas kernel keeps it in that expert's rows.
    """
    check_operands(lhs, rhs, group_sizes)
    a = dequantize_lhs(lhs)  # [M, K]
    w = jnp.swapaxes(dequantize_weights(rhs), -1, -2)  # [G, K, N]
    out = jax.lax.ragged_dot(
        a,
        w,
        group_sizes,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype)
