"""Store -> trainer: a step's guidance entry read back (`read_guidance`) and checked against the
guidance the trainer trained on (`check_same_guidance`), on one process or on each of a
multi-process run's, where each compares the rows its devices hold."""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from trace_jax.fp4 import Guidance
from trace_jax.guidance import GuidanceCorruptError, GuidanceStore


def read_guidance(
    store: GuidanceStore,
    run_id: str,
    step: int,
    micro_batch: int,
    *,
    mini_batches: int,
    max_staleness: int,
    write: concurrent.futures.Future | None = None,
    sharding: NamedSharding | None = None,
) -> tuple[dict[str, Guidance], dict[str, float]]:
    """Store -> trainer: mini-batch `micro_batch`'s entry of `step`, read once `write` (this
    process's pending write of it, if any) has committed, version-checked against the trainer's
    version `step * mini_batches + micro_batch`. Returns (guidance per site: host arrays, or
    with `sharding` global arrays placed by it, of which this process reads only its rows;
    seconds {"write_wait": waiting for `write`, "read": reading}); raises the write's
    failure."""
    w0 = time.perf_counter()
    if write is not None:
        write.result()
    r0 = time.perf_counter()
    guidance = store.read(
        run_id,
        step,
        micro_batch=micro_batch,
        expected_version=step * mini_batches + micro_batch,
        max_staleness=max_staleness,
        sharding=sharding,
    )
    return guidance, {"write_wait": r0 - w0, "read": time.perf_counter() - r0}


def check_same_guidance(read: dict[str, Guidance] | None, own: dict[str, Guidance], what: str):
    """Raises GuidanceCorruptError unless the entry `read` back from the store holds exactly the
    guidance `own` (site keys, formats, modes, shapes and the bytes of every leaf), `what` naming
    the entry; `read` None (a fallback read) is no copy either."""
    if read is None:
        raise GuidanceCorruptError(f"{what}: read back as a round-to-nearest fallback")
    if set(read) != set(own):
        raise GuidanceCorruptError(f"{what}: holds sites {sorted(read)}, expected {sorted(own)}")
    for site, g in own.items():
        r = read[site]
        for leaf in ("payload", "scales", "global_scale", "mask"):
            a, b = getattr(g, leaf), getattr(r, leaf)
            if (a is None) != (b is None) or (g.fmt, g.mode) != (r.fmt, r.mode):
                raise GuidanceCorruptError(f"{what}: site {site!r} {leaf} differs in kind")
            if a is None:
                continue
            if not _same_bytes_here(a, b):
                raise GuidanceCorruptError(
                    f"{what}: site {site!r} {leaf} differs from the guidance trained on"
                )


def _same_bytes_here(own: jax.Array | np.ndarray, read: jax.Array | np.ndarray) -> bool:
    """Whether `read` holds the bytes of `own` (same shape and item size) where this process
    can see `own`: all of it, or each of its local shards when other processes hold the rest
    (`read` a host array of the whole, or a global array placed like `own`)."""
    if own.shape != read.shape or np.dtype(own.dtype).itemsize != np.dtype(read.dtype).itemsize:
        return False
    if not isinstance(own, jax.Array) or own.is_fully_addressable:
        pairs = [(own, read)]
    elif isinstance(read, jax.Array):
        held = {_index_key(s.index, own.shape): s.data for s in read.addressable_shards}
        pairs = [(s.data, held.get(_index_key(s.index, own.shape))) for s in own.addressable_shards]
    else:
        pairs = [(s.data, np.asarray(read)[s.index]) for s in own.addressable_shards]
    return all(
        b is not None and np.array_equal(_bytes(np.asarray(a)), _bytes(np.asarray(b)))
        for a, b in pairs
    )


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
