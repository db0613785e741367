"""FP4 KV cache storage: K or V as packed codes plus block scales (4.25-4.5 bits per element).

The cache stores codes that are already quantized: whoever writes into it quantizes first (the
model with RTN, through the fused quantize op, the same computation as its "k"/"v" sites, so the
cache holds exactly the codes the guidance records). `read` dequantizes with `trace_jax.fp4`; the
FP4 decode-attention kernel reads the packed bytes directly.

Axis legend: B batch, T new tokens, S slots, Hkv kv heads, Dh head dim, NB = Dh / block.

The arrays are stored head-major ([B, Hkv, S, ...]): one kv head's slots are contiguous, so the
decode-attention kernel streams each program's rows instead of gathering 64-, 8- and 4-byte pieces
one kv head apart (on the H200 the loads alone took 0.40 ms instead of 0.60 ms at 128K slots).
The API speaks the logical [B, S, Hkv, Dh].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trace_jax.fp4.formats import BlockFormat
from trace_jax.fp4.packing import pack_fp4, unpack_fp4
from trace_jax.fp4.qtensor import QTensor, empty_scales
from trace_jax.fp4.quantize import dequantize


def write_slots(buf: jax.Array, value: jax.Array, slots: jax.Array, axis: int = 1) -> jax.Array:
    """`buf [B, ..., S, ...]` (S at `axis`) with `value [B, ..., T, ...]` written at `slots [B, T]`
    along `axis` of each batch row; slots out of range are dropped. One scatter per row (a vmap):
    on a mesh that splits B each device writes its own rows, where a scatter indexed by
    `arange(B)` makes XLA's partitioner all-gather its indices and updates."""
    before = (slice(None),) * (axis - 1)

    def row(b: jax.Array, v: jax.Array, s: jax.Array) -> jax.Array:
        return b.at[(*before, s)].set(v, mode="drop")

    return jax.vmap(row)(buf, value.astype(buf.dtype), slots)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedTensorCache:
    """One of K or V, head-major: codes uint8 [B, Hkv, S, Dh // 2] (two per byte), scales
    [B, Hkv, S, NB] in the format's scale dtype, global_scale float32 [B, Hkv, S, 1] (NVFP4) or
    None. `shape`, `empty`, `write` and `read` use the logical [B, S, Hkv, Dh]."""

    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array | None
    fmt: BlockFormat = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def empty(cls, shape: tuple[int, ...], fmt: BlockFormat) -> PackedTensorCache:
        """An all-zero cache for a logical [B, S, Hkv, Dh] tensor (finite scales everywhere)."""
        b, s, h, d = shape
        if not fmt.is_fp4:
            raise ValueError(f"the packed KV cache stores FP4; got {fmt.name}")
        if d % fmt.block_size:
            raise ValueError(
                f"head_dim {d} is not a multiple of the {fmt.name} block {fmt.block_size}"
            )
        return cls(
            codes=jnp.zeros((b, h, s, d // 2), jnp.uint8),
            scales=empty_scales((b, h, s, d // fmt.block_size), fmt),
            global_scale=jnp.ones((b, h, s, 1), jnp.float32) if fmt.has_global_scale else None,
            fmt=fmt,
        )

    def write(self, q: QTensor, slots: jax.Array) -> PackedTensorCache:
        """Stores the quantized `q [B, T, Hkv, Dh]` (this cache's format, NVFP4 with one global
        scale per row) at `slots [B, T]` (int; out of range: dropped)."""
        if q.fmt != self.fmt:
            raise ValueError(f"the cache holds {self.fmt.name}; got a {q.fmt.name} QTensor")
        b, _, h, d = self.shape
        if q.codes.ndim != 4 or (q.codes.shape[0], *q.codes.shape[2:]) != (b, h, d):
            raise ValueError(
                f"q must be [B, T, Hkv, Dh] with (B, Hkv, Dh) = {(b, h, d)}; got {q.codes.shape}"
            )
        rows_shape = (*q.codes.shape[:-1], 1)
        if q.global_scale is not None and q.global_scale.shape != rows_shape:
            raise ValueError(
                f"q.global_scale must be one per row, {rows_shape}; got {q.global_scale.shape}"
            )
        if slots.shape != q.codes.shape[:2]:
            raise ValueError(f"slots must be [B, T] = {q.codes.shape[:2]}; got {slots.shape}")

        def put(buf, val):  # val [B, T, Hkv, ...] -> rows (b, h, slots[b, t]) of the buffer
            return write_slots(buf, jnp.swapaxes(val, 1, 2), slots, axis=2)

        return PackedTensorCache(
            codes=put(self.codes, pack_fp4(q.codes)),
            scales=put(self.scales, q.scales),
            global_scale=None if q.global_scale is None else put(self.global_scale, q.global_scale),
            fmt=self.fmt,
        )

    def read(self, dtype) -> jax.Array:
        """All slots dequantized: [B, S, Hkv, Dh] in `dtype`."""
        slot_major = [None if a is None else jnp.swapaxes(a, 1, 2) for a in self._arrays]
        codes, scales, global_scale = slot_major
        return dequantize(QTensor(unpack_fp4(codes), scales, global_scale, self.fmt), dtype)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of the cached tensor [B, S, Hkv, Dh] (not of the packed bytes)."""
        b, h, s, half = self.codes.shape
        return (b, s, h, 2 * half)

    @property
    def _arrays(self) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        return self.codes, self.scales, self.global_scale

    @property
    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize for a in self._arrays if a is not None)
