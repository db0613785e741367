"""Store -> trainer: a step's guidance entry read back (`read_guidance`) and checked against the
guidance the trainer trained on (`check_same_guidance`), on one process or on each of a
multi-process run's, where each compares the rows its devices hold; the trainer's waits for
entries its background threads fetch (`GuidanceEntry`, `wait_for_entry`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from trace_jax.fp4 import Guidance
from trace_jax.guidance import GuidanceCorruptError, GuidanceStore


@dataclasses.dataclass(frozen=True)
class GuidanceEntry:
    """A mini-batch's entry as a background thread fetched it: its guidance (None: a counted RTN
    fallback), and when (`time.perf_counter`) its write had committed."""

    guidance: dict[str, Guidance] | None
    committed_at: float


def wait_for_entry(
    future: concurrent.futures.Future[GuidanceEntry], blocked: dict[str, float]
) -> GuidanceEntry:
    """The entry of `future` (its failure raised), adding the seconds waited for it to
    `blocked`: until its write committed to "write_wait", after that to "read"."""
    w0 = time.perf_counter()
    entry = future.result()
    w1 = time.perf_counter()
    write_wait = min(max(entry.committed_at - w0, 0.0), w1 - w0)
    blocked["write_wait"] += write_wait
    blocked["read"] += w1 - w0 - write_wait
    return entry


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
    return all(b is not None and _equal_bytes(np.asarray(a), np.asarray(b)) for a, b in pairs)


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def _equal_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `a` and `b` hold the same bytes in C order, compared 8 at a time (a bytewise
    compare of a step's tens of MB of guidance takes several times longer)."""
    a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    b = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    if a.size != b.size:
        return False
    words = a.size - a.size % 8
    return np.array_equal(a[:words].view(np.uint64), b[:words].view(np.uint64)) and np.array_equal(
        a[words:], b[words:]
    )
