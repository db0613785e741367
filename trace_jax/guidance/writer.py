"""`GuidanceWriter`: asynchronous writes of guidance entries, each committed by its manifest.

`write_async` validates the guidance in the caller, starts the device -> host copies and hands the
rest (host copy, zarr3 writes, commit) to a background thread, returning a future at once, so the
rollout's decode loop is not blocked; at most `max_pending_writes` writes are in flight.

A write puts its arrays under a data directory unique to the attempt, then commits by creating the
entry's manifest last, conditionally (create-if-absent): a reader sees all of an entry or none of
it, two writers of one entry cannot both win, and the loser deletes its own data. Any number of
writer processes may write different entries concurrently.

Guidance of global arrays (a multi-process run's batch, whose shards lie on several processes'
devices) is written by all the run's processes together: each calls `write_async` for the same
entry, in the same order, from its main thread (the data token is agreed there, a collective).
Each process writes the shards it owns (`shards.owned_shards`) and a part record of their
crc32s; after a barrier of all processes process 0 folds the part records into the manifest and
commits; after a second barrier every process's future reports the commit (or its failure).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
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
from trace_jax.guidance import layout, shards
from trace_jax.guidance.config import GuidanceStoreConfig
from trace_jax.guidance.errors import GuidanceError, GuidanceExistsError, GuidanceIOError
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
    """Validates a site -> Guidance dict (shapes and dtypes only: no device sync): either every
    leaf is global (shards on other processes: a write by all processes together) or none is."""
    if not isinstance(guidance, Mapping) or not guidance:
        raise ValueError(f"{key}: guidance must be a non-empty dict site key -> Guidance")
    kinds = set()
    for site, g in guidance.items():
        if not isinstance(site, str) or not site:
            raise ValueError(f"{key}: site keys must be non-empty strings, got {site!r}")
        if not isinstance(g, Guidance):
            raise TypeError(f"{key}: guidance[{site!r}] must be a Guidance, got {type(g).__name__}")
        try:
            g.check_matches(g.shape, g.fmt)
            for leaf, x in _leaves(g).items():
                layout.to_stored(leaf, np.empty((0,), x.dtype), g.fmt)  # dtype check only
                kinds.add(shards.is_global(x))
        except ValueError as e:
            raise ValueError(f"{key}: guidance[{site!r}]: {e}") from None
    if len(kinds) > 1:
        raise ValueError(
            f"{key}: some guidance leaves are global arrays (shards on other processes) and some "
            "are this process's own; a write is either by every process together or by this one"
        )
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

        Guidance of global arrays (shards on other processes' devices) is written by every
        process together: each calls this for the same entry, in the same order, from its main
        thread (a collective agrees on the data directory here) and writes the shards it owns;
        every process's future is done once process 0 has committed.

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
        # A write of global arrays is by all processes together: agree on its data directory.
        together = any(shards.is_global(x) for g in sites.values() for x in _leaves(g).values())
        token = shards.agree_token() if together else None
        self._slots.acquire()
        try:
            future = self._pool.submit(self.commit, key, version, sites, token)
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

    def commit(
        self, key: EntryKey, version: int, sites: dict[str, Guidance], token: str | None = None
    ) -> WriteResult:
        """Writes one validated entry and commits it (the background job of `write_async`);
        `token`: the data token agreed by all processes of a write of global arrays, else None.

        Raises:
          GuidanceExistsError: the entry is already committed, or another writer won the commit.
          GuidanceIOError: the kvstore failed, or the processes of the write did not all arrive.
          GuidanceError: another process of the write failed (its log says why).
        """
        t0 = time.perf_counter()
        if token is not None:
            return self._commit_together(key, version, sites, token, t0)
        host = {site: fetch_to_host(g) for site, g in sites.items()}
        current = self._check_absent(key)
        # Unique per attempt, so racing or retried writers never overwrite each other's data.
        data_dir = f"data_{uuid.uuid4().hex[:16]}"
        try:
            plans = [
                shards.LeafPlan.whole(self.config, key, data_dir, site, g.fmt, leaf, x)
                for site, g in sites.items()
                for leaf, x in host[site].items()
            ]
            crcs = self._write_plans(key, plans, create=True)
            self._commit_manifest(key, version, data_dir, sites, plans, crcs, current)
        except BaseException:
            self._delete_prefix(key.data_prefix(data_dir))
            raise
        return WriteResult(key, version, sum(p.nbytes for p in plans), time.perf_counter() - t0)

    def _commit_together(
        self, key: EntryKey, version: int, sites: dict[str, Guidance], token: str, t0: float
    ) -> WriteResult:
        """`commit` of global arrays, by every process: own shards, part record, barrier; process
        0 commits; barrier; each process checks the commit."""
        me, data_dir = jax.process_index(), f"data_{token}"
        barrier = f"guidance/{key.run}/{key.step}/{key.micro_batch}/{data_dir}"
        current, error, plans = None, None, []
        try:
            if me == 0:
                current = self._check_absent(key)
            plans = [
                shards.LeafPlan.owned(self.config, key, data_dir, site, g.fmt, leaf, x)
                for site, g in sites.items()
                for leaf, x in _leaves(g).items()
            ]
            crcs = self._write_plans(key, plans, create=me == 0)
            # The part record: site -> leaf -> {shard number: crc32} of the shards written here.
            written: dict[str, dict[str, dict[int, int]]] = {}
            for p, crc in zip(plans, crcs, strict=True):
                written.setdefault(p.site, {})[p.leaf] = crc
            record = json.dumps({"process": me, "crc32": written}).encode()
            kv_call(self._kv.store.write(key.part_key(data_dir, me), record), key)
        except Exception as e:  # reported after the barrier, so that no process waits for this one
            error = e
        self._barrier(key, f"{barrier}/data")
        if me == 0:
            try:
                if error is not None:
                    raise error
                crcs = self._gather_parts(key, data_dir, plans)
                self._commit_manifest(key, version, data_dir, sites, plans, crcs, current)
            except BaseException:
                self._delete_prefix(key.data_prefix(data_dir))
                raise
            finally:
                self._barrier(key, f"{barrier}/commit")
        else:
            self._barrier(key, f"{barrier}/commit")
            if error is not None:
                raise error
            got = kv_call(self._kv.store.read(key.manifest_key), key)
            try:
                committed = layout.decode_manifest(got.value)["data"] if got.value else None
            except ValueError as e:
                committed = f"an unreadable manifest ({e})"
            if committed != data_dir:
                raise GuidanceError(
                    f"{key}: process 0 did not commit this write (the manifest names "
                    f"{committed!r}, not {data_dir!r}); process 0's log says why"
                )
        return WriteResult(key, version, sum(p.nbytes for p in plans), time.perf_counter() - t0)

    def _check_absent(self, key: EntryKey):
        """The manifest's read result, if no manifest is there (the commit's condition)."""
        current = kv_call(self._kv.store.read(key.manifest_key), key)
        if current.state == "value":
            raise GuidanceExistsError(f"{key} is already committed ({key.manifest_key!r})")
        return current

    def _write_plans(
        self, key: EntryKey, plans: list[shards.LeafPlan], *, create: bool
    ) -> list[dict]:
        """Writes every plan's pieces (opens or, with `create`, creates each array first);
        returns each plan's {shard number: crc32}."""
        # Every inner chunk is stored, also one equal to the fill value (an all-zero block): the
        # reader treats a missing chunk as damage, so that a deleted chunk is detected. No fill
        # value could stand in: uint8 and bool leaves take every value of their type.
        # Only the creating process writes zarr.json; the others assume the same metadata.
        opened = [
            self._kv.open_zarr3(
                p.path,
                create=create,
                assume_metadata=not create,
                metadata=p.metadata,
                store_data_equal_to_fill_value=True,
            )
            for p in plans
        ]
        writes = []
        try:
            for p, f in zip(plans, opened, strict=True):
                array = kv_call(f, key)
                for flat, piece in p.pieces:
                    region = layout.shard_region(p.shape, p.shard_shape, flat)
                    writes.append(array[region].write(piece))
            for w in writes:
                kv_call(w, key)
        except BaseException:
            for f in opened + writes:  # settle before the caller deletes the data
                try:
                    f.result()
                except Exception:
                    pass
            raise
        return [{flat: layout.crc32(piece) for flat, piece in p.pieces} for p in plans]

    def _gather_parts(
        self, key: EntryKey, data_dir: str, plans: list[shards.LeafPlan]
    ) -> list[dict]:
        """Process 0: every process's part record folded into each plan's {shard: crc32}."""
        reads = [self._kv.store.read(key.part_key(data_dir, p)) for p in range(jax.process_count())]
        crcs: list[dict[int, int]] = [{} for _ in plans]
        for process, f in enumerate(reads):
            got = kv_call(f, key)
            if got.state != "value":
                raise GuidanceError(
                    f"{key}: process {process} wrote no part record: its write failed (its log "
                    "says why)"
                )
            part = json.loads(got.value)["crc32"]
            for i, p in enumerate(plans):
                for flat, crc in part.get(p.site, {}).get(p.leaf, {}).items():
                    if int(flat) in crcs[i]:
                        raise GuidanceError(f"{key}: {p.site} {p.leaf} shard {flat} written twice")
                    crcs[i][int(flat)] = crc
        for i, p in enumerate(plans):
            missing = sorted(set(range(p.n_shards)) - set(crcs[i]))
            if missing:
                raise GuidanceError(f"{key}: no process wrote {p.site} {p.leaf} shards {missing}")
        return crcs

    def _commit_manifest(self, key, version, data_dir, sites, plans, crcs, current) -> None:
        """Creates the manifest if absent (`current`: the manifest's read before the write)."""
        maybe_die("guidance_write", key.step)  # TRACE_JAX_FAULT: data written, no commit
        site_docs: dict[str, Any] = {
            site: {
                "dir": layout.site_dir(site),
                "fmt": g.fmt.name,
                "mode": g.mode.value,
                "shape": list(g.shape),
                "leaves": {},
            }
            for site, g in sites.items()
        }
        for p, crc in zip(plans, crcs, strict=True):
            site_docs[p.site]["leaves"][p.leaf] = {
                "shape": list(p.shape),
                "dtype": str(layout.logical_dtype(p.leaf, p.fmt)),
                "stored_dtype": layout.STORED_DTYPE[p.leaf],
                "shard_shape": list(p.shard_shape),
                "crc32": [crc[i] for i in range(p.n_shards)],
            }
        body = {
            "schema": layout.SCHEMA,
            "run": key.run,
            "step": key.step,
            "micro_batch": key.micro_batch,
            "policy_version": version,
            "data": data_dir,
            "nbytes": sum(p.nbytes for p in plans),
            "sites": site_docs,
            "writer": {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "processes": jax.process_count(),
                "time": time.time(),
            },
        }
        committed = kv_call(
            self._kv.store.write(
                key.manifest_key, layout.encode_manifest(body), if_equal=current.stamp.generation
            ),
            key,
        )
        if not committed.generation:  # the create-if-absent condition failed
            raise GuidanceExistsError(f"{key} was committed by another writer meanwhile")

    def _barrier(self, key: EntryKey, name: str) -> None:
        try:
            shards.barrier(name, self.config.barrier_timeout_s)
        except Exception as e:
            raise GuidanceIOError(
                f"{key}: the processes of a multi-process write did not all reach {name!r} "
                f"within {self.config.barrier_timeout_s:g} s: {e}"
            ) from e

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
