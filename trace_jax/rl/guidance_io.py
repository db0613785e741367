"""Store -> trainer: a step's guidance entry read back (`read_guidance`) and checked against the
guidance the trainer trained on (`check_same_guidance`), on one process or on each of a
multi-process run's, where each compares the rows its devices hold; the trainer's waits for
entries its background threads fetch (`GuidanceEntry`, `wait_for_entry`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from trace_jax.fp4 import Guidance
from trace_jax.guidance import GuidanceCorruptError, GuidanceStore
from trace_jax.guidance.shards import Span, span


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
            difference = _differences_here(a, b)
            if difference is not None:
                raise GuidanceCorruptError(f"{what}: site {site!r} {leaf} {difference}")


def _differences_here(own: jax.Array | np.ndarray, read: jax.Array | np.ndarray) -> str | None:
    """None when `read` holds the bytes of `own` (same shape and item size) wherever this
    process holds `read` (all of it, or the local shards of a global array: over the processes
    they cover it); else what differs."""
    if own.shape != read.shape or np.dtype(own.dtype).itemsize != np.dtype(read.dtype).itemsize:
        return f"is {read.dtype}{list(read.shape)}, trained on {own.dtype}{list(own.shape)}"
    return differences_in_parts(
        _local_parts(own), _local_parts(read), getattr(own, "sharding", None)
    )


def differences_in_parts(
    own: list[tuple[Span, jax.Array | np.ndarray]],
    read: list[tuple[Span, jax.Array | np.ndarray]],
    placement=None,
) -> str | None:
    """`_differences_here` on the parts (span, data) each copy has here. The copies may be
    placed differently (a replicated guidance trained on, a read split by rows): each part of
    `read` is compared with the overlapping parts of `own` (placed by `placement`), which must
    hold it whole."""
    for where, data in read:
        covered = 0
        for there, held in own:
            overlap = tuple(
                (max(a, c), min(b, d)) for (a, b), (c, d) in zip(where, there, strict=True)
            )
            if any(a >= b for a, b in overlap):
                continue
            mine = np.asarray(data)[_local_index(overlap, where)]
            theirs = np.asarray(held)[_local_index(overlap, there)]
            if not _equal_bytes(theirs, mine):
                n = int(np.sum(_as_bytes(theirs) != _as_bytes(mine)))
                return f"differs from the guidance trained on ({n} bytes in {_spans(overlap)})"
            covered += math.prod(b - a for a, b in overlap)
        if covered < math.prod(b - a for a, b in where):
            return (
                f"rows {_spans(where)} are read on this process, which holds only "
                f"{[_spans(t) for t, _ in own]} of the guidance trained on (placed by "
                f"{placement}): not checkable here"
            )
    return None


def _local_parts(x: jax.Array | np.ndarray) -> list[tuple[Span, jax.Array | np.ndarray]]:
    """(span, data) of what this process holds of `x`: the whole array (a host array or a
    fully addressable one), else each distinct local shard once."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return [(tuple((0, d) for d in x.shape), x)]
    parts = {span(s.index, x.shape): s.data for s in x.addressable_shards}
    return list(parts.items())


def _local_index(region: Span, within: Span) -> tuple[slice, ...]:
    return tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(region, within, strict=True))


def _spans(where: Span) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in where) + "]"


def _as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


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
