"""`GuidanceStore`: rollout guidance on a tensorstore kvstore, from rollout to training (SPEC 5).

The rollout writes each micro-batch's guidance (site key -> `trace_jax.fp4.Guidance`) with
`write_async`, which returns a future at once so the decode loop is not blocked. Training reads an
entry back with `read` (or `read_async` to prefetch) before the step that needs it. Rollout and
training may be separate processes or hosts linked only by the store:

* Entries are keyed by (run, step, micro-batch) and record the policy version the rollout sampled
  with. The trainer publishes the version it is at (`publish_version`); the rollout waits for a
  recent enough one (`wait_for_version`) and records it; `read` accepts an entry only if its
  version is in `[expected_version - max_staleness, expected_version]` (`versions.py`).
* A write commits by creating the entry's manifest last, conditionally (create-if-absent), so a
  reader sees all of an entry or none of it, and two writers of one entry cannot both win
  (`writer.py`).
* Every read is verified (checksums, shapes, dtypes, layout); missing, corrupt or wrong-version
  guidance raises, or with `fallback="rtn"` returns None, counted and logged (`reader.py`).
* `gc(run, up_to_step)` deletes consumed steps, `discard_from(run, step)` the steps a resumed run
  samples again, each one key-range delete (`gc.py`).

The store composes these parts over one kvstore: a local directory by default
(`GuidanceStoreConfig.kvstore`), `{"driver": "memory"}` for tests (per process), or object
storage for multi-host runs: "s3://bucket/prefix/" (`S3Options` for an S3-compatible server:
endpoint, region, credentials; conditional writes make the create-if-absent commit atomic there),
"gs://bucket/prefix/", or any tensorstore kvstore spec (`config.py`). A process that only writes
or only reads may use `GuidanceWriter` or `GuidanceReader` alone. The on-disk layout is described
in `trace_jax.guidance.layout`.

In a multi-process run (`jax.distributed`) whose guidance is global arrays, rows split over the
mesh, every process calls `write_async` for the entry and writes only the shards it holds;
process 0 commits after all have written (`writer.py`, `shards.py`). `read(..., sharding=...)`
returns global arrays, each process reading and verifying only the rows its devices hold.
"""

from __future__ import annotations

import logging
from typing import Any

from trace_jax.guidance.config import Fallback, GuidanceStoreConfig
from trace_jax.guidance.errors import GuidanceError
from trace_jax.guidance.gc import GarbageCollector
from trace_jax.guidance.kvstore import Kv
from trace_jax.guidance.reader import GuidanceReader
from trace_jax.guidance.versions import PolicyVersions
from trace_jax.guidance.writer import GuidanceWriter, WriteResult

__all__ = ["Fallback", "GuidanceStore", "GuidanceStoreConfig", "WriteResult"]

log = logging.getLogger(__name__)


class _Delegated:
    """A `GuidanceStore` attribute that is one of its parts': `store.<name>` is
    `store.<part>.<attr>` (a bound method, or a property's value), so the part's signature and
    docstring are the only ones."""

    def __init__(self, part: str, cls: type, attr: str):
        self.part, self.attr = part, attr
        self.__doc__ = f"`{cls.__name__}.{attr}`: {getattr(cls, attr).__doc__}"

    def __get__(self, store: GuidanceStore | None, owner: type | None = None) -> Any:
        return self if store is None else getattr(getattr(store, self.part), self.attr)


class GuidanceStore:
    """Writes and reads rollout guidance entries; see the module docstring.

    Attributes:
      config: the `GuidanceStoreConfig`.
      writer: the `GuidanceWriter` (asynchronous writes and commits).
      reader: the `GuidanceReader` (verified reads, RTN fallback counts).
      versions: the `PolicyVersions` (published policy version per run).
      collector: the `GarbageCollector` (listing and deleting entries).

    The other attributes are the parts' own, named below (`store.read` is `store.reader.read`).
    Thread-safe. Use as a context manager, or call `close()` (which flushes) when done.
    """

    def __init__(self, config: GuidanceStoreConfig | None = None):
        self.config = config or GuidanceStoreConfig()
        kv = Kv.open(self.config)
        self.writer = GuidanceWriter(kv, self.config)
        self.reader = GuidanceReader(kv, self.config)
        self.versions = PolicyVersions(kv, poll_s=self.config.poll_s)
        self.collector = GarbageCollector(kv)

    @classmethod
    def in_memory(cls, **overrides) -> GuidanceStore:
        """A store on a fresh in-memory kvstore (this process only): for tests."""
        return cls(GuidanceStoreConfig(kvstore={"driver": "memory"}, **overrides))

    # Writing: asynchronous writes, each committed by its manifest.
    write_async = _Delegated("writer", GuidanceWriter, "write_async")
    write = _Delegated("writer", GuidanceWriter, "write")
    flush = _Delegated("writer", GuidanceWriter, "flush")

    # Reading: verified reads with a counted RTN fallback.
    read = _Delegated("reader", GuidanceReader, "read")
    read_async = _Delegated("reader", GuidanceReader, "read_async")
    fallback_count = _Delegated("reader", GuidanceReader, "fallback_count")
    fallbacks = _Delegated("reader", GuidanceReader, "fallbacks")
    read_manifest = _Delegated("reader", GuidanceReader, "read_manifest")
    exists = _Delegated("reader", GuidanceReader, "exists")
    wait = _Delegated("reader", GuidanceReader, "wait")

    # The policy-version handshake: the trainer publishes, the rollout waits.
    publish_version = _Delegated("versions", PolicyVersions, "publish")
    published_version = _Delegated("versions", PolicyVersions, "published")
    wait_for_version = _Delegated("versions", PolicyVersions, "wait_for")

    # Listing and garbage collection.
    entries = _Delegated("collector", GarbageCollector, "entries")
    gc = _Delegated("collector", GarbageCollector, "collect")
    discard_from = _Delegated("collector", GarbageCollector, "discard_from")

    def close(self) -> None:
        """Flushes, then stops the background threads. Idempotent."""
        try:
            self.writer.close()
        finally:
            self.reader.close()

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
