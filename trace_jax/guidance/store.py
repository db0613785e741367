"""`GuidanceStore`: rollout guidance on a tensorstore kvstore, from rollout to training (SPEC 5).

The rollout writes each micro-batch's guidance (site key -> `trace_jax.fp4.Guidance`) with
`write_async`, which starts the device -> host copies, hands the rest (host copy, zarr3 writes,
commit) to a background thread and returns a future at once, so the decode loop is not blocked.
Training reads an entry back with `read` (or `read_async` to prefetch) before the step that needs
it. Rollout and training may be separate processes or hosts linked only by the store:

* Entries are keyed by (run, step, micro-batch) and record the policy version the rollout sampled
  with. The trainer publishes the version it is at (`publish_version`); the rollout waits for a
  recent enough one (`wait_for_version`) and records it; `read` accepts an entry only if its
  version is in `[expected_version - max_staleness, expected_version]`.
* A write commits by creating the entry's manifest last, conditionally (create-if-absent), so a
  reader sees all of an entry or none of it, and two writers of one entry cannot both win. Any
  number of writer processes may write different entries concurrently.
* Every read is verified: crc32c of every inner chunk and shard index (zarr3 sharding codec),
  crc32 of every leaf and of the manifest (end to end), shapes, dtypes and the `Guidance` layout.
* Missing, corrupt or wrong-version guidance raises `GuidanceMissingError`,
  `GuidanceCorruptError` or `GuidanceVersionError`, naming the entry. With `fallback="rtn"` (in
  the config or per read) `read` returns None instead, counted in `fallback_count` and logged;
  the trainer then quantizes that micro-batch with round-to-nearest. Nothing is used silently.
* `gc(run, up_to_step)` deletes consumed steps (one key-range delete).

The kvstore is a local directory by default (`GuidanceStoreConfig.kvstore`), `{"driver":
"memory"}` for tests (per process), or any tensorstore kvstore spec or URL ("gs://bucket/dir/",
"s3://...") for multi-host runs. The on-disk layout is described in `trace_jax.guidance.layout`.

Reads return host (numpy) arrays; place them with `jax.device_put(guidance, sharding)`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from trace_jax.fp4.formats import get_format
from trace_jax.fp4.guidance import Guidance, GuidanceMode
from trace_jax.guidance import layout
from trace_jax.guidance.errors import (
    GuidanceCorruptError,
    GuidanceError,
    GuidanceExistsError,
    GuidanceIOError,
    GuidanceMissingError,
    GuidanceVersionError,
)
from trace_jax.guidance.layout import EntryKey

log = logging.getLogger(__name__)

# tensorstore status codes that, for a committed entry, mean its stored data is damaged.
_CORRUPT_CODES = (
    "DATA_LOSS",
    "NOT_FOUND",
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "OUT_OF_RANGE",
)
_MANIFEST_RE = re.compile(r"step_(\d{10})/mb_(\d{5})/" + re.escape(layout.MANIFEST) + "$")


class Fallback(enum.StrEnum):
    """What `read` does with missing, corrupt or wrong-version guidance."""

    ERROR = "error"  # raise the GuidanceError
    RTN = "rtn"  # return None (the trainer rounds to nearest), count it in `fallback_count`


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuidanceStoreConfig:
    """Where and how guidance is stored.

    Attributes:
      kvstore: a local directory (default "guidance_store", made absolute), a tensorstore kvstore
        URL ("gs://bucket/dir/", "s3://bucket/dir/", "memory://") or a kvstore spec dict
        ({"driver": "memory"}, {"driver": "gcs", "bucket": ..., "path": ...}), passed through.
      fallback: default for `read`: "error" raises, "rtn" returns None and counts it.
      max_staleness: default for `read`: accepted policy versions are
        `[expected_version - max_staleness, expected_version]` (the paper allows up to 3).
      max_pending_writes: `write_async` blocks while this many writes are in flight (bounds the
        host memory held by copies).
      write_threads: background threads doing host copies, zarr3 writes and commits.
      inner_chunk_bytes: target size of a checksummed inner chunk within each shard.
      zstd_level: compress inner chunks with zstd at this level (None: raw; FP4 codes and mantissa
        bits are near-random, so compression gains little).
      poll_s: polling interval of `read(timeout_s=...)`, `wait` and `wait_for_version`.
      durable: fsync every file of an entry before it counts as committed (a local-directory
        kvstore; tensorstore's `file_io_sync`). Off (default): a committed entry survives the
        crash of any process but not of the machine; a torn entry after a machine crash fails
        its checksums (a clear error, and the step's rollout is redone on resume). An fsync per
        file costs most of the store's time on local disks (dozens of files per entry).
    """

    kvstore: str | Mapping[str, Any] = "guidance_store"
    fallback: Fallback = Fallback.ERROR
    max_staleness: int = 0
    max_pending_writes: int = 4
    write_threads: int = 2
    inner_chunk_bytes: int = 1 << 20
    zstd_level: int | None = None
    poll_s: float = 0.02
    durable: bool = False

    def __post_init__(self):
        object.__setattr__(self, "fallback", Fallback(self.fallback))
        if not isinstance(self.kvstore, str | Mapping) or not self.kvstore:
            raise ValueError(f"kvstore must be a path, URL or spec dict, got {self.kvstore!r}")
        if isinstance(self.kvstore, Mapping) and "driver" not in self.kvstore:
            raise ValueError(f"a kvstore spec dict needs a 'driver', got {dict(self.kvstore)}")
        for name in ("max_pending_writes", "write_threads", "inner_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.zstd_level is not None and not -131072 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in [-131072, 22] or None, got {self.zstd_level}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {self.poll_s}")

    def kvstore_spec(self) -> str | dict[str, Any]:
        """The tensorstore kvstore spec: dicts and URLs as given, plain paths as a file kvstore."""
        if isinstance(self.kvstore, Mapping):
            return dict(self.kvstore)
        if "://" in self.kvstore:
            return self.kvstore
        return {"driver": "file", "path": os.path.abspath(self.kvstore) + "/"}


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """A committed write: its entry, policy version, bytes stored and seconds in the background."""

    key: EntryKey
    policy_version: int
    nbytes: int
    seconds: float


def _check_version(name: str, version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int | np.integer) or version < 0:
        raise ValueError(f"{name} must be a non-negative int, got {version!r}")
    return int(version)


def _leaves(g: Guidance) -> dict[str, Any]:
    return {leaf: getattr(g, leaf) for leaf in layout.LEAVES if getattr(g, leaf) is not None}


def _check_guidance(guidance: Mapping[str, Guidance], key: EntryKey) -> dict[str, Guidance]:
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


def _fetch_to_host(g: Guidance) -> dict[str, np.ndarray]:
    """The guidance leaves as host arrays (blocks until the device -> host copies are done)."""
    return {leaf: np.asarray(jax.device_get(x)) for leaf, x in _leaves(g).items()}


class GuidanceStore:
    """Writes and reads rollout guidance entries; see the module docstring.

    Thread-safe. Use as a context manager, or call `close()` (which flushes) when done.
    """

    def __init__(self, config: GuidanceStoreConfig | None = None):
        self.config = config or GuidanceStoreConfig()
        self._ctx = ts.Context({"file_io_sync": bool(self.config.durable)})
        kv = ts.KvStore.open(self.config.kvstore_spec(), context=self._ctx).result()
        if kv.path and not kv.path.endswith("/"):
            kv.path = kv.path + "/"
        self._kv = kv
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.config.max_pending_writes)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.config.write_threads, thread_name_prefix="guidance-write"
        )
        self._read_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._unflushed: list[concurrent.futures.Future] = []
        self._fallbacks: collections.Counter[str] = collections.Counter()
        self._closed = False

    @classmethod
    def in_memory(cls, **overrides) -> GuidanceStore:
        """A store on a fresh in-memory kvstore (this process only): for tests."""
        return cls(GuidanceStoreConfig(kvstore={"driver": "memory"}, **overrides))

    # ---- writing ------------------------------------------------------------------------------

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
        version = _check_version("policy_version", policy_version)
        sites = _check_guidance(guidance, key)
        if self._closed:
            raise GuidanceError(f"{key}: the store is closed")
        for g in sites.values():
            for x in _leaves(g).values():
                if isinstance(x, jax.Array):
                    x.copy_to_host_async()
        self._slots.acquire()
        try:
            future = self._pool.submit(self._write, key, version, sites)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(self._write_done)
        with self._lock:
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
            if self._read_pool is not None:
                self._read_pool.shutdown(wait=True)

    def __enter__(self) -> GuidanceStore:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not mask the exception in flight
            self.close()
        except GuidanceError as e:
            log.error("while closing the guidance store: %s", e)

    def _write_done(self, future: concurrent.futures.Future) -> None:
        self._slots.release()
        if not future.cancelled() and future.exception() is not None:
            log.error("guidance write failed: %s", future.exception())

    def _write(self, key: EntryKey, version: int, sites: dict[str, Guidance]) -> WriteResult:
        t0 = time.perf_counter()
        host = {site: _fetch_to_host(g) for site, g in sites.items()}
        current = self._kv_call(self._kv.read(key.manifest_key), key)
        if current.state == "value":
            raise GuidanceExistsError(f"{key} is already committed ({key.manifest_key!r})")

        data_dir = f"data_{uuid.uuid4().hex[:16]}"
        data_prefix = f"{key.prefix}{data_dir}/"
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
                    path = f"{data_prefix}{layout.site_dir(site)}/{leaf}/"
                    opened = ts.open(
                        {"driver": "zarr3", "metadata": md},
                        kvstore=self._kv / path,
                        create=True,
                        context=self._ctx,
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
                writes.append(self._kv_call(opened, key).write(stored))
            for w in writes:
                self._kv_call(w, key)
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
            committed = self._kv_call(
                self._kv.write(
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
            self._delete_prefix(data_prefix)
            raise
        return WriteResult(key, version, nbytes, time.perf_counter() - t0)

    # ---- reading ------------------------------------------------------------------------------

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
    ) -> dict[str, Guidance] | None:
        """Reads and verifies one entry: site key -> `Guidance` with host (numpy) arrays.

        Args:
          run, step, micro_batch: the entry.
          expected_version: the trainer's policy version for this step.
          max_staleness: accept versions `expected_version - max_staleness .. expected_version`
            (default: the config's).
          sites: site keys to return (all of them must be present); None: every stored site.
          fallback: "error" or "rtn" (default: the config's); see `Fallback`.
          timeout_s: wait up to this long for the entry to be committed.

        Returns:
          The guidance, or None on a counted RTN fallback.

        Raises:
          GuidanceMissingError, GuidanceCorruptError, GuidanceVersionError (fallback "error");
          GuidanceIOError if the kvstore fails (never a fallback).
        """
        key = EntryKey(run, step, micro_batch)
        expected = _check_version("expected_version", expected_version)
        staleness = self.config.max_staleness if max_staleness is None else max_staleness
        if staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {staleness}")
        fallback = self.config.fallback if fallback is None else Fallback(fallback)
        sites = None if sites is None else list(sites)
        try:
            return self._read(key, expected, staleness, sites, timeout_s)
        except (GuidanceMissingError, GuidanceCorruptError, GuidanceVersionError) as e:
            if fallback is Fallback.ERROR:
                raise
            reason = {
                GuidanceMissingError: "missing",
                GuidanceCorruptError: "corrupt",
                GuidanceVersionError: "version",
            }[type(e)]
            with self._lock:
                self._fallbacks[reason] += 1
                count = sum(self._fallbacks.values())
            log.warning("%s -- falling back to round-to-nearest (RTN fallback #%d)", e, count)
            return None

    def read_async(
        self, run: str, step: int, **kwargs
    ) -> concurrent.futures.Future[dict[str, Guidance] | None]:
        """`read` on a background thread (prefetch the next step's guidance)."""
        with self._lock:
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
        return self._kv_call(self._kv.read(key.manifest_key), key).state == "value"

    def wait(self, run: str, step: int, micro_batch: int = 0, *, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the entry to be committed; returns whether it is."""
        deadline = time.monotonic() + timeout_s
        while not self.exists(run, step, micro_batch):
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.config.poll_s)
        return True

    def _manifest(self, key: EntryKey, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self._kv_call(self._kv.read(key.manifest_key), key)
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
    ) -> dict[str, Guidance]:
        manifest = self._manifest(key, timeout_s)
        version = manifest["policy_version"]
        if not expected - staleness <= version <= expected:
            window = f"{expected}" if staleness == 0 else f"{expected - staleness}..{expected}"
            raise GuidanceVersionError(
                f"{key} was sampled with policy version {version}, but the trainer expects "
                f"{window} (max_staleness={staleness})"
            )
        stored_sites = manifest["sites"]
        wanted = list(stored_sites) if sites is None else sites
        absent = sorted(set(wanted) - set(stored_sites))
        if absent:
            raise GuidanceMissingError(
                f"{key} has no guidance for sites {absent}; it holds {sorted(stored_sites)}"
            )

        data_prefix = f"{key.prefix}{manifest['data']}/"
        opened = []
        for site in wanted:
            doc = stored_sites[site]
            for leaf, leaf_doc in doc["leaves"].items():
                path = f"{data_prefix}{doc['dir']}/{leaf}/"
                f = ts.open(
                    {"driver": "zarr3", "fill_missing_data_reads": False},
                    kvstore=self._kv / path,
                    open=True,
                    context=self._ctx,
                )
                opened.append((site, leaf, leaf_doc, path, f))
        reads = []
        for site, leaf, leaf_doc, path, f in opened:
            arr = self._ts_call(f, key, path)
            want = (tuple(leaf_doc["shape"]), np.dtype(leaf_doc["stored_dtype"]))
            got = (tuple(arr.shape), np.dtype(arr.dtype.numpy_dtype))
            if got != want:
                raise GuidanceCorruptError(
                    f"{key}: {path!r} holds (shape, dtype) {got}, the manifest says {want}"
                )
            reads.append((site, leaf, leaf_doc, path, arr.read()))
        arrays: dict[str, dict[str, np.ndarray]] = collections.defaultdict(dict)
        for site, leaf, leaf_doc, path, f in reads:
            x = self._ts_call(f, key, path)
            if layout.crc32(x) != leaf_doc["crc32"]:
                raise GuidanceCorruptError(
                    f"{key}: {path!r}: crc32 {layout.crc32(x):08x} != {leaf_doc['crc32']:08x} "
                    "recorded at write time"
                )
            arrays[site][leaf] = x

        out = {}
        for site in wanted:
            doc = stored_sites[site]
            try:
                fmt = get_format(doc["fmt"])
                mode = GuidanceMode(doc["mode"])
                leaves = {k: layout.from_stored(k, v, fmt) for k, v in arrays[site].items()}
                if "payload" not in leaves or "scales" not in leaves:
                    raise ValueError("payload or scales not stored")
                g = Guidance(
                    leaves["payload"],
                    leaves["scales"],
                    leaves.get("global_scale"),
                    leaves.get("mask"),
                    fmt,
                    mode,
                )
                g.check_matches(tuple(doc["shape"]), fmt)
            except ValueError as e:
                raise GuidanceCorruptError(f"{key}: site {site!r}: {e}") from None
            out[site] = g
        return out

    # ---- policy-version handshake --------------------------------------------------------------

    def publish_version(self, run: str, version: int) -> None:
        """Trainer: records that run `run` is now at policy `version` (never moves backwards)."""
        key = layout.version_key(run)
        version = _check_version("version", version)
        for _ in range(100):
            current = self._kv_call(self._kv.read(key), key)
            if current.state == "value":
                at = self._decode_version(run, current.value)
                if version < at:
                    raise ValueError(
                        f"run {run!r} is at policy version {at}; cannot publish older {version}"
                    )
            doc = {"version": version, "time": time.time(), "pid": os.getpid()}
            done = self._kv_call(
                self._kv.write(key, json.dumps(doc).encode(), if_equal=current.stamp.generation),
                key,
            )
            if done.generation:
                return
        raise GuidanceIOError(f"could not publish policy version {version} of run {run!r}")

    def published_version(self, run: str) -> int | None:
        """The policy version the trainer published for `run` (None before the first)."""
        key = layout.version_key(run)
        got = self._kv_call(self._kv.read(key), key)
        return self._decode_version(run, got.value) if got.state == "value" else None

    def wait_for_version(self, run: str, at_least: int, *, timeout_s: float) -> int:
        """Rollout: waits until the published version is >= `at_least`; returns it.

        Raises:
          TimeoutError: naming the run, the version waited for and the last one seen.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            version = self.published_version(run)
            if version is not None and version >= at_least:
                return version
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"run {run!r}: policy version {at_least} not published within {timeout_s:g} s "
                    f"(latest: {version})"
                )
            time.sleep(self.config.poll_s)

    def _decode_version(self, run: str, raw: bytes) -> int:
        try:
            return _check_version("version", json.loads(raw)["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise GuidanceCorruptError(
                f"run {run!r}: {layout.version_key(run)!r} is not a valid version record ({e})"
            ) from None

    # ---- listing and garbage collection --------------------------------------------------------

    def entries(self, run: str) -> list[tuple[int, int]]:
        """Committed entries of `run` as sorted (step, micro_batch) pairs."""
        prefix = f"{layout.check_run(run)}/step_"
        keys = self._kv_call(
            self._kv.list(
                ts.KvStore.KeyRange(prefix, layout.prefix_range_end(prefix)),
                strip_prefix_length=len(run) + 1,
            ),
            run,
        )
        found = (_MANIFEST_RE.fullmatch(k.decode()) for k in keys)
        return sorted((int(m[1]), int(m[2])) for m in found if m)

    def gc(self, run: str, up_to_step: int) -> list[tuple[int, int]]:
        """Deletes every entry of `run` with step <= `up_to_step` (consumed); returns them.

        Later steps and the published policy version are kept. Also removes uncommitted data of
        those steps (e.g. from a writer that died before committing).
        """
        if up_to_step < 0:
            return []
        removed = [e for e in self.entries(run) if e[0] <= up_to_step]
        lo = f"{run}/step_"
        hi = layout.step_prefix(run, up_to_step + 1) if up_to_step < layout.MAX_STEP else None
        self._kv_call(
            self._kv.delete_range(ts.KvStore.KeyRange(lo, hi or layout.prefix_range_end(lo))), run
        )
        self._remove_empty_dirs(run, lambda s: s <= up_to_step)
        return removed

    def discard_from(self, run: str, step: int) -> list[tuple[int, int]]:
        """Deletes every entry of `run` with step >= `step` (committed or not); returns them.

        For a run resumed from its checkpoint at `step - 1`: an interrupted attempt may have
        committed guidance for steps it never trained, and the resumed run samples them again.
        (Only for a run whose rollout and trainer restart together; a separate rollout worker's
        entries ahead of the trainer are live.)
        """
        lo = layout.step_prefix(run, step)
        end = layout.prefix_range_end(f"{run}/step_")
        removed = [e for e in self.entries(run) if e[0] >= step]
        self._kv_call(self._kv.delete_range(ts.KvStore.KeyRange(lo, end)), run)
        self._remove_empty_dirs(run, lambda s: s >= step)
        return removed

    def _delete_prefix(self, prefix: str) -> None:
        try:
            rng = ts.KvStore.KeyRange(prefix, layout.prefix_range_end(prefix))
            self._kv.delete_range(rng).result()
            self._prune_dirs(prefix)
        except Exception as e:  # best effort: the data is unreachable without a manifest
            log.warning("could not delete uncommitted guidance data %r: %s", prefix, e)

    def _remove_empty_dirs(self, run: str, collected: Callable[[int], bool]) -> None:
        """Removes the empty directories of steps `collected(step)` (file kvstore only)."""
        root = self._file_root()
        run_dir = os.path.join(root, run) if root else None
        if run_dir is None or not os.path.isdir(run_dir):
            return
        for name in os.listdir(run_dir):
            step = name.removeprefix("step_")
            if name.startswith("step_") and step.isdigit() and collected(int(step)):
                self._prune_dirs(f"{run}/{name}/")

    def _prune_dirs(self, prefix: str) -> None:
        """The file driver leaves empty directories after `delete_range`: remove those under
        `prefix` (only ever a collected step or a failed write's own data directory)."""
        root = self._file_root()
        if root is None:
            return
        top = os.path.join(root, prefix)
        for dirpath, _, _ in sorted(os.walk(top), reverse=True):  # children before parents
            try:
                os.rmdir(dirpath)  # only succeeds when empty
            except OSError:
                pass

    def _file_root(self) -> str | None:
        spec = self._kv.spec().to_json()
        return spec["path"] if spec.get("driver") == "file" else None

    # ---- errors -------------------------------------------------------------------------------

    @staticmethod
    def _kv_call(future, where):
        """Result of a kvstore future; failures become `GuidanceIOError` naming `where`."""
        try:
            return future.result()
        except Exception as e:
            raise GuidanceIOError(f"{where}: kvstore operation failed: {e}") from e

    @staticmethod
    def _ts_call(future, key: EntryKey, path: str):
        """Result of a zarr3 open/read of a committed entry; damage -> `GuidanceCorruptError`."""
        try:
            return future.result()
        except Exception as e:
            if str(e).startswith(_CORRUPT_CODES):
                raise GuidanceCorruptError(f"{key}: {path!r}: {e}") from e
            raise GuidanceIOError(f"{key}: {path!r}: {e}") from e
