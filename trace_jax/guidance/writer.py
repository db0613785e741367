"""`GuidanceWriter`: asynchronous writes of guidance entries, each committed by its manifest.

`write_async` validates the guidance in the caller, starts the device -> host copies and hands the
rest (host copy, zarr3 writes, commit) to a background thread, returning a future at once, so the
rollout's decode loop is not blocked; at most `max_pending_writes` writes are in flight.

A write puts its arrays under a data directory unique to the attempt, then commits by creating the
entry's manifest last, conditionally (create-if-absent): a reader sees all of an entry or none of
it, two writers of one entry cannot both win, and the loser deletes its own data. Any number of
writer processes may write different entries concurrently.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from trace_jax.faults import maybe_die
from trace_jax.fp4.guidance import Guidance
from trace_jax.guidance import layout
from trace_jax.guidance.config import GuidanceStoreConfig
from trace_jax.guidance.errors import GuidanceError, GuidanceExistsError
from trace_jax.guidance.kvstore import Kv, kv_call
from trace_jax.guidance.layout import EntryKey
from trace_jax.guidance.versions import check_version

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """A committed write: its entry, policy version, bytes stored and seconds in the background."""

    key: EntryKey
    policy_version: int
    nbytes: int
    seconds: float


def _leaves(g: Guidance) -> dict[str, Any]:
    return {leaf: getattr(g, leaf) for leaf in layout.LEAVES if getattr(g, leaf) is not None}


def check_guidance(guidance: Mapping[str, Guidance], key: EntryKey) -> dict[str, Guidance]:
    """Validates a site -> Guidance dict (shapes and dtypes only: no device sync)."""
    if not isinstance(guidance, Mapping) or not guidance:
        raise ValueError(f"{key}: guidance must be a non-empty dict site key -> Guidance")
    for site, g in guidance.items():
        if not isinstance(site, str) or not site:
            raise ValueError(f"{key}: site keys must be non-empty strings, got {site!r}")
        if not isinstance(g, Guidance):
            raise TypeError(f"{key}: guidance[{site!r}] must be a Guidance, got {type(g).__name__}")
        try:
            g.check_matches(g.shape, g.fmt)
            for leaf, x in _leaves(g).items():
                layout.to_stored(leaf, np.empty((0,), x.dtype), g.fmt)  # dtype check only
                if isinstance(x, jax.Array) and not x.is_fully_addressable:
                    raise ValueError(
                        f"{leaf} is not fully addressable; each process writes its own "
                        "micro-batches as process-local arrays"
                    )
        except ValueError as e:
            raise ValueError(f"{key}: guidance[{site!r}]: {e}") from None
    return dict(guidance)


def fetch_to_host(g: Guidance) -> dict[str, np.ndarray]:
    """The guidance leaves as host arrays (blocks until the device -> host copies are done)."""
    return {leaf: np.asarray(jax.device_get(x)) for leaf, x in _leaves(g).items()}


class GuidanceWriter:
    """Writes and commits entries on background threads. Thread-safe; `close()` when done."""

    def __init__(self, kv: Kv, config: GuidanceStoreConfig):
        self.config = config
        self._kv = kv
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(config.max_pending_writes)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            config.write_threads, thread_name_prefix="guidance-write"
        )
        self._unflushed: list[concurrent.futures.Future] = []
        self._closed = False

    def write_async(
        self,
        run: str,
        step: int,
        guidance: Mapping[str, Guidance],
        *,
        policy_version: int,
        micro_batch: int = 0,
    ) -> concurrent.futures.Future[WriteResult]:
        """Starts writing one entry; returns at once with a future of its `WriteResult`.

        The device -> host copies start here (`copy_to_host_async`); the host copy, the zarr3
        writes and the commit run on a background thread. The entry is visible to readers once the
        future is done. Blocks only while `max_pending_writes` writes are in flight. Keep the
        guidance arrays alive (do not donate or delete them) until the future is done.

        Args:
          run: run name (letters, digits, '.', '_', '-').
          step: the training step that will consume this guidance.
          guidance: site key ("layer/name") -> `Guidance`.
          policy_version: the policy version the rollout sampled with.
          micro_batch: index of the micro-batch within the step.

        The future raises `GuidanceExistsError` if the entry was already committed, and
        `GuidanceIOError` if the kvstore fails. `flush()` re-raises failures of unchecked writes.
        """
        key = EntryKey(run, step, micro_batch)
        version = check_version("policy_version", policy_version)
        sites = check_guidance(guidance, key)
        if self._closed:
            raise GuidanceError(f"{key}: the guidance writer is closed")
        for g in sites.values():
            for x in _leaves(g).values():
                if isinstance(x, jax.Array):
                    x.copy_to_host_async()
        self._slots.acquire()
        try:
            future = self._pool.submit(self.commit, key, version, sites)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(self._write_done)
        with self._lock:
            # Failed futures stay until `flush` reports them, even if the caller inspected them.
            self._unflushed = [f for f in self._unflushed if not f.done() or f.exception()]
            self._unflushed.append(future)
        return future

    def write(
        self,
        run: str,
        step: int,
        guidance: Mapping[str, Guidance],
        *,
        policy_version: int,
        micro_batch: int = 0,
    ) -> WriteResult:
        """Writes and commits one entry (`write_async(...).result()`); raises its failure here
        rather than from a later `flush()`."""
        future = self.write_async(
            run, step, guidance, policy_version=policy_version, micro_batch=micro_batch
        )
        try:
            return future.result()
        finally:
            with self._lock:
                self._unflushed = [f for f in self._unflushed if f is not future]

    def flush(self) -> None:
        """Waits until every write started so far is committed or failed.

        Raises:
          GuidanceError: if any `write_async` since the last flush failed, even one whose future
            was already inspected (the first failure is the cause).
        """
        with self._lock:
            futures, self._unflushed = self._unflushed, []
        concurrent.futures.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise GuidanceError(
                f"{len(errors)} guidance write(s) failed; the first: {errors[0]}"
            ) from errors[0]

    def close(self) -> None:
        """Flushes, then stops the background threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)

    def commit(self, key: EntryKey, version: int, sites: dict[str, Guidance]) -> WriteResult:
        """Writes one validated entry and commits it (the background job of `write_async`).

        Raises:
          GuidanceExistsError: the entry is already committed, or another writer won the commit.
          GuidanceIOError: the kvstore failed.
        """
        t0 = time.perf_counter()
        host = {site: fetch_to_host(g) for site, g in sites.items()}
        current = kv_call(self._kv.store.read(key.manifest_key), key)
        if current.state == "value":
            raise GuidanceExistsError(f"{key} is already committed ({key.manifest_key!r})")

        # Unique per attempt, so racing or retried writers never overwrite each other's data.
        data_dir = f"data_{uuid.uuid4().hex[:16]}"
        pending, writes = [], []
        try:
            site_docs: dict[str, Any] = {}
            nbytes = 0
            for site, g in sites.items():
                leaf_docs = {}
                for leaf, x in host[site].items():
                    stored = layout.to_stored(leaf, x, g.fmt)
                    dtype = layout.STORED_DTYPE[leaf]
                    md = layout.array_metadata(
                        stored.shape,
                        dtype,
                        inner_chunk_bytes=self.config.inner_chunk_bytes,
                        zstd_level=self.config.zstd_level,
                    )
                    path = key.leaf_prefix(data_dir, layout.site_dir(site), leaf)
                    # Every inner chunk is stored, also one equal to the fill value (an all-zero
                    # block): the reader treats a missing chunk as damage, so that a deleted chunk
                    # is detected. No fill value could stand in: uint8 and bool leaves take every
                    # value of their type.
                    opened = self._kv.open_zarr3(
                        path, create=True, metadata=md, store_data_equal_to_fill_value=True
                    )
                    pending.append((opened, stored))
                    leaf_docs[leaf] = {
                        "shape": list(stored.shape),
                        "dtype": str(layout.logical_dtype(leaf, g.fmt)),
                        "stored_dtype": dtype,
                        "crc32": layout.crc32(stored),
                    }
                    nbytes += stored.nbytes
                site_docs[site] = {
                    "dir": layout.site_dir(site),
                    "fmt": g.fmt.name,
                    "mode": g.mode.value,
                    "shape": list(g.shape),
                    "leaves": leaf_docs,
                }
            for opened, stored in pending:
                writes.append(kv_call(opened, key).write(stored))
            for w in writes:
                kv_call(w, key)
            maybe_die("guidance_write", key.step)  # TRACE_JAX_FAULT: data written, no commit
            body = {
                "schema": layout.SCHEMA,
                "run": key.run,
                "step": key.step,
                "micro_batch": key.micro_batch,
                "policy_version": version,
                "data": data_dir,
                "nbytes": nbytes,
                "sites": site_docs,
                "writer": {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()},
            }
            committed = kv_call(
                self._kv.store.write(
                    key.manifest_key,
                    layout.encode_manifest(body),
                    if_equal=current.stamp.generation,
                ),
                key,
            )
            if not committed.generation:  # the create-if-absent condition failed
                raise GuidanceExistsError(f"{key} was committed by another writer meanwhile")
        except BaseException:
            for f in [opened for opened, _ in pending] + writes:  # settle before deleting
                try:
                    f.result()
                except Exception:
                    pass
            self._delete_prefix(key.data_prefix(data_dir))
            raise
        return WriteResult(key, version, nbytes, time.perf_counter() - t0)

    def _write_done(self, future: concurrent.futures.Future) -> None:
        self._slots.release()
        if not future.cancelled() and future.exception() is not None:
            log.error("guidance write failed: %s", future.exception())

    def _delete_prefix(self, prefix: str) -> None:
        try:
            rng = ts.KvStore.KeyRange(prefix, layout.prefix_range_end(prefix))
            self._kv.store.delete_range(rng).result()
            self._kv.prune_dirs(prefix)
        except Exception as e:  # best effort: the data is unreachable without a manifest
            log.warning("could not delete uncommitted guidance data %r: %s", prefix, e)
