"""`GuidanceReader`: verified reads of committed guidance entries, with a counted RTN fallback.

Every read is verified: the manifest's crc32 and its (run, step, micro-batch), the policy version
against the staleness window, crc32c of every inner chunk and shard index (zarr3 sharding codec),
crc32 of every stored shard it reads (end to end: catches a valid shard swapped in from another
entry), shapes, dtypes and the `Guidance` layout. Missing, corrupt or wrong-version guidance raises
`GuidanceMissingError`, `GuidanceCorruptError` or `GuidanceVersionError`, naming the entry; with
`fallback="rtn"` `read` returns None instead, counted in `fallback_count` and logged, and the
trainer quantizes that micro-batch with round-to-nearest. Nothing is used silently.

Reads return host (numpy) arrays of whole leaves, or with `sharding` global `jax.Array`s placed
by it: each process then reads only the stored shards that overlap the rows its devices hold
(`shards.py`), so it checks those shards alone. In a multi-process run a damaged shard therefore
raises (or falls back) on the processes that read it, not on all of them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from trace_jax.fp4.formats import BlockFormat, get_format
from trace_jax.fp4.guidance import Guidance, GuidanceMode
from trace_jax.guidance import layout, shards
from trace_jax.guidance.config import Fallback, GuidanceStoreConfig
from trace_jax.guidance.errors import (
    GuidanceCorruptError,
    GuidanceError,
    GuidanceMissingError,
    GuidanceVersionError,
)
from trace_jax.guidance.kvstore import Kv, kv_call, ts_call
from trace_jax.guidance.layout import EntryKey
from trace_jax.guidance.versions import check_staleness, check_version

log = logging.getLogger(__name__)

_FALLBACK_REASON = {
    GuidanceMissingError: "missing",
    GuidanceCorruptError: "corrupt",
    GuidanceVersionError: "version",
}


class GuidanceReader:
    """Reads and verifies entries; counts RTN fallbacks. Thread-safe; `close()` when done."""

    def __init__(self, kv: Kv, config: GuidanceStoreConfig):
        self.config = config
        self._kv = kv
        self._lock = threading.Lock()
        self._read_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._fallbacks: collections.Counter[str] = collections.Counter()
        self._closed = False

    def read(
        self,
        run: str,
        step: int,
        *,
        expected_version: int,
        micro_batch: int = 0,
        max_staleness: int | None = None,
        sites: Iterable[str] | None = None,
        fallback: str | Fallback | None = None,
        timeout_s: float = 0.0,
        sharding: jax.sharding.NamedSharding | None = None,
    ) -> dict[str, Guidance] | None:
        """Reads and verifies one entry: site key -> `Guidance` with host (numpy) arrays, or with
        `sharding` global arrays placed by it.

        Args:
          run, step, micro_batch: the entry.
          expected_version: the trainer's policy version for this step.
          max_staleness: accept versions `expected_version - max_staleness .. expected_version`
            (default: the config's).
          sites: site keys to return (all of them must be present); None: every stored site.
          fallback: "error" or "rtn" (default: the config's); see `Fallback`.
          timeout_s: wait up to this long for the entry to be committed.
          sharding: place every leaf by it (rows `[B, ...]` split over its mesh axes), reading
            only the stored shards this process's devices need; its spec is cut to each leaf's
            rank, and an axis it cannot split evenly (a per-tensor global scale `[1, 1]`) is
            kept whole. None: whole host arrays.

        Returns:
          The guidance, or None on a counted RTN fallback.

        Raises:
          GuidanceMissingError, GuidanceCorruptError, GuidanceVersionError (fallback "error");
          GuidanceIOError if the kvstore fails (never a fallback).
        """
        key = EntryKey(run, step, micro_batch)
        expected = check_version("expected_version", expected_version)
        staleness = self.config.max_staleness if max_staleness is None else max_staleness
        if staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {staleness}")
        fallback = self.config.fallback if fallback is None else Fallback(fallback)
        sites = None if sites is None else list(sites)
        if sharding is not None and not isinstance(sharding, jax.sharding.NamedSharding):
            raise TypeError(f"sharding must be a NamedSharding or None, got {sharding!r}")
        try:
            return self._read(key, expected, staleness, sites, timeout_s, sharding)
        except (GuidanceMissingError, GuidanceCorruptError, GuidanceVersionError) as e:
            if fallback is Fallback.ERROR:
                raise
            with self._lock:
                self._fallbacks[_FALLBACK_REASON[type(e)]] += 1
                count = sum(self._fallbacks.values())
            log.warning("%s -- falling back to round-to-nearest (RTN fallback #%d)", e, count)
            return None

    def read_async(
        self, run: str, step: int, **kwargs
    ) -> concurrent.futures.Future[dict[str, Guidance] | None]:
        """`read` on a background thread (prefetch the next step's guidance)."""
        with self._lock:
            if self._closed:
                raise GuidanceError(f"cannot prefetch step {step} of run {run!r}: reader closed")
            if self._read_pool is None:
                self._read_pool = concurrent.futures.ThreadPoolExecutor(
                    2, thread_name_prefix="guidance-read"
                )
        return self._read_pool.submit(self.read, run, step, **kwargs)

    @property
    def fallback_count(self) -> int:
        """How many reads fell back to RTN (missing + corrupt + wrong version)."""
        with self._lock:
            return sum(self._fallbacks.values())

    @property
    def fallbacks(self) -> dict[str, int]:
        """RTN fallbacks by reason: "missing", "corrupt", "version"."""
        with self._lock:
            return dict(self._fallbacks)

    def read_manifest(self, run: str, step: int, micro_batch: int = 0) -> dict[str, Any]:
        """The verified manifest of a committed entry (raises Missing / Corrupt errors)."""
        return self._manifest(EntryKey(run, step, micro_batch), timeout_s=0.0)

    def exists(self, run: str, step: int, micro_batch: int = 0) -> bool:
        """Whether the entry is committed."""
        key = EntryKey(run, step, micro_batch)
        return kv_call(self._kv.store.read(key.manifest_key), key).state == "value"

    def wait(self, run: str, step: int, micro_batch: int = 0, *, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the entry to be committed; returns whether it is."""
        deadline = time.monotonic() + timeout_s
        while not self.exists(run, step, micro_batch):
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.config.poll_s)
        return True

    def close(self) -> None:
        """Stops the prefetch threads (after their reads finish). Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._read_pool = self._read_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _manifest(self, key: EntryKey, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            got = kv_call(self._kv.store.read(key.manifest_key), key)
            if got.state == "value":
                break
            if time.monotonic() >= deadline:
                waited = f" after waiting {timeout_s:g} s" if timeout_s > 0 else ""
                raise GuidanceMissingError(
                    f"{key}: no committed guidance ({key.manifest_key!r} is absent{waited}); "
                    "the rollout has not written it yet, its write failed, or it was "
                    "garbage-collected"
                )
            time.sleep(self.config.poll_s)
        try:
            body = layout.decode_manifest(got.value)
        except ValueError as e:
            raise GuidanceCorruptError(f"{key}: manifest {key.manifest_key!r}: {e}") from None
        where = (body.get("run"), body.get("step"), body.get("micro_batch"))
        if where != (key.run, key.step, key.micro_batch):
            raise GuidanceCorruptError(
                f"{key}: manifest {key.manifest_key!r} describes (run, step, micro_batch) {where}"
            )
        return body

    def _read(
        self,
        key: EntryKey,
        expected: int,
        staleness: int,
        sites: list[str] | None,
        timeout_s: float,
        sharding: jax.sharding.NamedSharding | None,
    ) -> dict[str, Guidance]:
        manifest = self._manifest(key, timeout_s)
        check_staleness(key, manifest["policy_version"], expected, staleness)
        stored_sites = manifest["sites"]
        wanted = list(stored_sites) if sites is None else sites
        absent = sorted(set(wanted) - set(stored_sites))
        if absent:
            raise GuidanceMissingError(
                f"{key} has no guidance for sites {absent}; it holds {sorted(stored_sites)}"
            )
        fmts, modes = {}, {}
        for site in wanted:
            try:
                fmts[site] = get_format(stored_sites[site]["fmt"])
                modes[site] = GuidanceMode(stored_sites[site]["mode"])
            except (KeyError, ValueError) as e:
                raise GuidanceCorruptError(f"{key}: site {site!r}: {e}") from None
        arrays = self._read_leaves(key, manifest, fmts, sharding)
        out = {}
        for site in wanted:
            leaves = arrays[site]
            try:
                if "payload" not in leaves or "scales" not in leaves:
                    raise ValueError("payload or scales not stored")
                g = Guidance(
                    leaves["payload"],
                    leaves["scales"],
                    leaves.get("global_scale"),
                    leaves.get("mask"),
                    fmts[site],
                    modes[site],
                )
                g.check_matches(tuple(stored_sites[site]["shape"]), fmts[site])
            except ValueError as e:
                raise GuidanceCorruptError(f"{key}: site {site!r}: {e}") from None
            out[site] = g
        return out

    def _read_leaves(
        self,
        key: EntryKey,
        manifest: dict[str, Any],
        fmts: dict[str, BlockFormat],
        sharding: jax.sharding.NamedSharding | None,
    ) -> dict[str, dict[str, np.ndarray | jax.Array]]:
        """site -> leaf -> array (logical dtype): whole host arrays, or global arrays placed by
        `sharding` built from the shards this process needs. Every stored shard read is checked
        against the manifest's shapes, dtypes and crc32s."""
        # Open every array, then start every read, then wait: the kvstore round trips overlap.
        opened = []
        for site, fmt in fmts.items():
            doc = manifest["sites"][site]
            for leaf, leaf_doc in doc["leaves"].items():
                path = key.leaf_prefix(manifest["data"], doc["dir"], leaf)
                # A missing chunk is damage here, not the fill value.
                f = self._kv.open_zarr3(path, fill_missing_data_reads=False)
                opened.append((site, fmt, leaf, leaf_doc, path, f))
        reads = []
        for site, fmt, leaf, leaf_doc, path, f in opened:
            arr = ts_call(f, key, path)
            shape, shard_shape = tuple(leaf_doc["shape"]), tuple(leaf_doc["shard_shape"])
            want = (shape, np.dtype(leaf_doc["stored_dtype"]))
            got = (tuple(arr.shape), np.dtype(arr.dtype.numpy_dtype))
            if got != want:
                raise GuidanceCorruptError(
                    f"{key}: {path!r} holds (shape, dtype) {got}, the manifest says {want}"
                )
            if sharding is None:
                placed, flats = None, list(range(len(leaf_doc["crc32"])))
                regions = {i: layout.shard_region(shape, shard_shape, i) for i in flats}
                pending = [(flats, arr.read())]  # the whole array at once, checked per shard
            else:
                placed = shards.leaf_sharding(sharding, shape)
                flats = shards.needed_shards(placed, shape, shard_shape)
                regions = {i: layout.shard_region(shape, shard_shape, i) for i in flats}
                pending = [([i], arr[regions[i]].read()) for i in flats]
            reads.append((site, fmt, leaf, leaf_doc, path, placed, regions, pending))
        arrays: dict[str, dict[str, np.ndarray | jax.Array]] = collections.defaultdict(dict)
        for site, fmt, leaf, leaf_doc, path, placed, regions, pending in reads:
            pieces = {}
            for flats, f in pending:
                x = ts_call(f, key, path)
                for i in flats:
                    piece = x[regions[i]] if placed is None else x  # the whole array: cut shard i
                    if layout.crc32(piece) != leaf_doc["crc32"][i]:
                        raise GuidanceCorruptError(
                            f"{key}: {path!r} shard {i}: crc32 {layout.crc32(piece):08x} != "
                            f"{leaf_doc['crc32'][i]:08x} recorded at write time"
                        )
                    pieces[i] = layout.from_stored(leaf, piece, fmt)
            if placed is None:
                arrays[site][leaf] = layout.from_stored(leaf, x, fmt)
            else:
                shape, shard_shape = tuple(leaf_doc["shape"]), tuple(leaf_doc["shard_shape"])
                arrays[site][leaf] = shards.place(pieces, shape, shard_shape, placed)
        return arrays
