"""Which process writes and which reads each stored shard of a guidance leaf (multi-process runs).

In a run of several processes the rollout's guidance is a global `jax.Array` (a batch, rows split
over the mesh's "data" axis) that no process holds whole. The store keeps one zarr3 shard per jax
shard (`layout.array_metadata(shard_shape=...)`), so that:

* each process writes whole objects of its own (`owned_shards`, `LeafPlan.owned`): every
  distinct jax shard once, by the lowest process holding it (ties: its lowest device), so a shard
  replicated across processes (a per-tensor global scale) is written by one process alone;
* each process reads only the stored shards that overlap what its devices hold under the
  requested sharding (`needed_shards`), checks their crc32s and builds its part of one global
  array (`place`, through `jax.make_array_from_callback`);
* the processes of one write meet at named barriers of JAX's coordination service (`barrier`):
  not a device collective, so safe from the store's background threads while the main thread
  runs jitted steps; the write's data token is agreed in the caller (`agree_token`, a collective).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import uuid
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from orbax.checkpoint import multihost

from trace_jax.fp4.formats import BlockFormat
from trace_jax.guidance import layout
from trace_jax.guidance.config import GuidanceStoreConfig
from trace_jax.guidance.layout import EntryKey

Span = tuple[tuple[int, int], ...]  # (start, stop) per axis


def is_global(x) -> bool:
    """Whether `x` is a `jax.Array` with shards on other processes' devices."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def span(index: tuple[slice, ...], shape: tuple[int, ...]) -> Span:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def stored_shard_shape(x: jax.Array) -> tuple[int, ...]:
    """The zarr3 shard shape of a global array: its jax shard shape (at least 1 per axis)."""
    return tuple(max(1, c) for c in x.sharding.shard_shape(x.shape))


def owned_shards(x: jax.Array) -> list[tuple[int, jax.Array]]:
    """The shards of `x` this process writes: (shard number in C order over the grid of
    `stored_shard_shape(x)`, the shard's data on a local device), each distinct shard owned by
    the lowest (process, device) holding it. Raises ValueError for a sharding whose shards do
    not tile `x` on a regular grid."""
    shape, shard_shape = x.shape, stored_shard_shape(x)
    grid = layout.shard_grid(shape, shard_shape)
    owner: dict[int, jax.Device] = {}
    for device, index in x.sharding.devices_indices_map(shape).items():
        where = span(index, shape)
        cell = tuple(a // c for (a, _), c in zip(where, shard_shape, strict=True))
        aligned = all(
            (a, b) == (i * c, min((i + 1) * c, d))
            for (a, b), i, c, d in zip(where, cell, shard_shape, shape, strict=True)
        )
        if not aligned:
            raise ValueError(
                f"shard {where} of an array {shape} placed by {x.sharding} is off the regular "
                f"grid of {shard_shape} shards"
            )
        flat = int(np.ravel_multi_index(cell, grid))
        best = owner.get(flat)
        if best is None or (device.process_index, device.id) < (best.process_index, best.id):
            owner[flat] = device
    local = {s.device: s.data for s in x.addressable_shards}
    me = jax.process_index()
    return sorted(
        ((flat, local[d]) for flat, d in owner.items() if d.process_index == me),
        key=lambda item: item[0],
    )


def leaf_sharding(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """`sharding` for one leaf of `shape`: its spec cut to the leaf's rank, and an axis it
    splits kept whole instead where the split is uneven (a per-tensor global scale `[1, 1]`)."""
    mesh, spec = sharding.mesh, tuple(sharding.spec)[: len(shape)]
    out = []
    for d, names in itertools.zip_longest(shape, spec):
        axes = () if names is None else names if isinstance(names, tuple) else (names,)
        split = math.prod(mesh.shape[a] for a in axes)
        out.append(names if axes and d % split == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*out), memory_kind=sharding.memory_kind)


def needed_shards(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], shard_shape: tuple[int, ...]
) -> list[int]:
    """The stored shards (numbers in C order over the grid) that overlap what this process's
    devices hold of an array `shape` placed by `sharding`."""
    grid = layout.shard_grid(shape, shard_shape)
    need: set[int] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        ranges = [
            range(a // c, max(a // c + 1, -(-b // c)))
            for (a, b), c in zip(span(index, shape), shard_shape, strict=True)
        ]
        need.update(int(np.ravel_multi_index(cell, grid)) for cell in itertools.product(*ranges))
    return sorted(need)


def place(
    pieces: Mapping[int, np.ndarray],
    shape: tuple[int, ...],
    shard_shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
) -> jax.Array:
    """The global array `shape` placed by `sharding`, each local device's part cut from the
    stored shards `pieces` (shard number -> its data; those of `needed_shards`)."""
    dtype = next(iter(pieces.values())).dtype
    regions = {flat: layout.shard_region(shape, shard_shape, flat) for flat in pieces}

    def part(index: tuple[slice, ...]) -> np.ndarray:
        want = span(index, shape)
        out = np.empty([b - a for a, b in want], dtype)
        for flat, piece in pieces.items():
            # The overlap of the wanted part and this shard, in each one's own coordinates.
            dst, src = [], []
            for (a, b), r in zip(want, regions[flat], strict=True):
                lo, hi = max(a, r.start), min(b, r.stop)
                dst.append(slice(lo - a, hi - a))
                src.append(slice(lo - r.start, hi - r.start))
            if all(d.start < d.stop for d in dst):
                out[tuple(dst)] = piece[tuple(src)]
        return out

    return jax.make_array_from_callback(shape, sharding, part, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One leaf's zarr3 array and the pieces of it one process writes: (shard number, stored
    data of that shard)."""

    site: str
    leaf: str
    fmt: BlockFormat
    path: str
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    metadata: dict[str, Any]
    pieces: list[tuple[int, np.ndarray]]

    @property
    def n_shards(self) -> int:
        return math.prod(layout.shard_grid(self.shape, self.shard_shape))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array (all processes' pieces)."""
        return math.prod(self.shape) * np.dtype(layout.STORED_DTYPE[self.leaf]).itemsize

    @classmethod
    def whole(
        cls,
        config: GuidanceStoreConfig,
        key: EntryKey,
        data_dir: str,
        site: str,
        fmt: BlockFormat,
        leaf: str,
        x: np.ndarray,
    ) -> LeafPlan:
        """The whole host array `x`, one shard."""
        stored = layout.to_stored(leaf, x, fmt)
        md = layout.array_metadata(
            stored.shape,
            layout.STORED_DTYPE[leaf],
            inner_chunk_bytes=config.inner_chunk_bytes,
            zstd_level=config.zstd_level,
        )
        shard_shape = tuple(md["chunk_grid"]["configuration"]["chunk_shape"])
        path = key.leaf_prefix(data_dir, layout.site_dir(site), leaf)
        return cls(site, leaf, fmt, path, stored.shape, shard_shape, md, [(0, stored)])

    @classmethod
    def owned(
        cls,
        config: GuidanceStoreConfig,
        key: EntryKey,
        data_dir: str,
        site: str,
        fmt: BlockFormat,
        leaf: str,
        x: jax.Array,
    ) -> LeafPlan:
        """The shards of the global array `x` this process owns, one stored shard per jax shard."""
        shard_shape = stored_shard_shape(x)
        md = layout.array_metadata(
            x.shape,
            layout.STORED_DTYPE[leaf],
            inner_chunk_bytes=config.inner_chunk_bytes,
            zstd_level=config.zstd_level,
            shard_shape=shard_shape,
        )
        pieces = [
            (flat, layout.to_stored(leaf, np.asarray(data), fmt)) for flat, data in owned_shards(x)
        ]
        path = key.leaf_prefix(data_dir, layout.site_dir(site), leaf)
        return cls(site, leaf, fmt, path, tuple(x.shape), shard_shape, md, pieces)


def agree_token() -> str:
    """A fresh hex token, process 0's on every process: a collective (every process calls it,
    in the same order, from its main thread)."""
    mine = np.frombuffer(uuid.uuid4().bytes[:8], np.uint8)
    agreed = multihost_utils.broadcast_one_to_all(mine)
    return bytes(np.asarray(agreed, np.uint8)).hex()


def barrier(name: str, timeout_s: float) -> None:
    """Waits until every process reaches the barrier `name` (unique per use), at most
    `timeout_s`; JAX's coordination service raises on a timeout. One process: returns at once."""
    multihost.get_barrier_sync_fn()(key=name, timeout_ms=int(timeout_s * 1000))
