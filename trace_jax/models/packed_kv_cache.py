"""FP4 KV cache: K and V stored as packed codes plus block scales (4.25-4.5 bits per element).

Writes quantize the raw K/V per token and head (blocks along head_dim) with round-to-nearest, the
same quantizer the rollout's "k"/"v" sites run, so the cache holds exactly the codes the guidance
records. With `kernel_backend="pallas"` writes go through the fused Pallas quantize kernel and
decode steps attend with the Pallas FP4 decode-attention kernel, which reads the packed bytes
directly; with "xla" reads dequantize to the compute dtype. Both give identical codes.

Axis legend: B batch, S slots, Hkv kv heads, Dh head dim, NB = Dh / block.

The arrays are stored head-major ([B, Hkv, S, ...]): one kv head's slots are contiguous, so the
decode-attention kernel streams each program's rows instead of gathering 64-, 8- and 4-byte pieces
one kv head apart (on the H200 the loads alone took 0.40 ms instead of 0.60 ms at 128K slots,
`experiments/results/kernels_findings.md` item 14). The API speaks the logical [B, S, Hkv, Dh].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trace_jax import fp4
from trace_jax.fp4 import BlockFormat, QTensor


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
    kernel_backend: str = dataclasses.field(default="xla", metadata=dict(static=True))

    @classmethod
    def empty(
        cls, shape: tuple[int, ...], fmt: BlockFormat, kernel_backend: str = "xla"
    ) -> PackedTensorCache:
        """An all-zero cache for a logical [B, S, Hkv, Dh] tensor."""
        b, s, h, d = shape
        if not fmt.is_fp4:
            raise ValueError(f"the packed KV cache stores FP4; got {fmt.name}")
        if d % fmt.block_size:
            raise ValueError(
                f"head_dim {d} is not a multiple of the {fmt.name} block {fmt.block_size}"
            )
        return cls(
            codes=jnp.zeros((b, h, s, d // 2), jnp.uint8),
            scales=fp4.empty_scales((b, h, s, d // fmt.block_size), fmt),
            global_scale=jnp.ones((b, h, s, 1), jnp.float32) if fmt.has_global_scale else None,
            fmt=fmt,
            kernel_backend=kernel_backend,
        )

    def write(self, x: jax.Array, slots: jax.Array) -> PackedTensorCache:
        """Quantizes `x [B, T, Hkv, Dh]` (RTN) into `slots [B, T]` (out of range: dropped)."""
        if self.kernel_backend == "pallas":
            from kernels_pallas.fp4_quantize import fp4_quantize

            q = fp4_quantize(x, self.fmt, backend="pallas").qtensor()
        else:
            q = fp4.quantize(x, self.fmt)
        b, _, h = x.shape[:3]
        rows = (jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], slots[:, None, :])

        def put(buf, val):  # val [B, T, Hkv, ...] -> rows (b, h, slots[b, t]) of the buffer
            return buf.at[rows].set(jnp.swapaxes(val, 1, 2), mode="drop")

        return PackedTensorCache(
            codes=put(self.codes, fp4.pack_fp4(q.codes)),
            scales=put(self.scales, q.scales),
            global_scale=None if q.global_scale is None else put(self.global_scale, q.global_scale),
            fmt=self.fmt,
            kernel_backend=self.kernel_backend,
        )

    def read(self, dtype) -> jax.Array:
        """All slots dequantized: [B, S, Hkv, Dh] in `dtype`."""
        slot_major = [None if a is None else jnp.swapaxes(a, 1, 2) for a in self._arrays]
        codes, scales, global_scale = slot_major
        return fp4.dequantize(QTensor(fp4.unpack_fp4(codes), scales, global_scale, self.fmt), dtype)

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLayerKVCache:
    """One layer's FP4 cache; the packed twin of `LayerKVCache`."""

    k: PackedTensorCache
    v: PackedTensorCache
