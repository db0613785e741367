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
(`GuidanceStoreConfig.kvstore`), `{"driver": "memory"}` for tests (per process), or any
tensorstore kvstore spec or URL ("gs://bucket/dir/", "s3://...") for multi-host runs. A process
that only writes or only reads may use `GuidanceWriter` or `GuidanceReader` alone. The on-disk
layout is described in `trace_jax.guidance.layout`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from trace_jax.fp4.guidance import Guidance
from trace_jax.guidance.config import Fallback, GuidanceStoreConfig
from trace_jax.guidance.errors import GuidanceError
from trace_jax.guidance.gc import GarbageCollector
from trace_jax.guidance.kvstore import Kv
from trace_jax.guidance.reader import GuidanceReader
from trace_jax.guidance.versions import PolicyVersions
from trace_jax.guidance.writer import GuidanceWriter, WriteResult

__all__ = ["Fallback", "GuidanceStore", "GuidanceStoreConfig", "WriteResult"]

log = logging.getLogger(__name__)


class GuidanceStore:
    """Writes and reads rollout guidance entries; see the module docstring.

    Attributes:
      config: the `GuidanceStoreConfig`.
      writer: the `GuidanceWriter` (asynchronous writes and commits).
      reader: the `GuidanceReader` (verified reads, RTN fallback counts).
      versions: the `PolicyVersions` (published policy version per run).
      collector: the `GarbageCollector` (listing and deleting entries).

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

    # ---- writing: `GuidanceWriter` -------------------------------------------------------------

    def write_async(
        self,
        run: str,
        step: int,
        guidance: Mapping[str, Guidance],
        *,
        policy_version: int,
        micro_batch: int = 0,
    ) -> concurrent.futures.Future[WriteResult]:
        """Starts writing one entry; returns a future of its `WriteResult` (`GuidanceWriter`)."""
        return self.writer.write_async(
            run, step, guidance, policy_version=policy_version, micro_batch=micro_batch
        )

    def write(
        self,
        run: str,
        step: int,
        guidance: Mapping[str, Guidance],
        *,
        policy_version: int,
        micro_batch: int = 0,
    ) -> WriteResult:
        """Writes and commits one entry, raising its failure here (`GuidanceWriter.write`)."""
        return self.writer.write(
            run, step, guidance, policy_version=policy_version, micro_batch=micro_batch
        )

    def flush(self) -> None:
        """Waits for every write started so far; raises `GuidanceError` if any failed."""
        self.writer.flush()

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

    # ---- reading: `GuidanceReader` -------------------------------------------------------------

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
        """Reads and verifies one entry; None on a counted RTN fallback (`GuidanceReader.read`)."""
        return self.reader.read(
            run,
            step,
            expected_version=expected_version,
            micro_batch=micro_batch,
            max_staleness=max_staleness,
            sites=sites,
            fallback=fallback,
            timeout_s=timeout_s,
        )

    def read_async(
        self, run: str, step: int, **kwargs
    ) -> concurrent.futures.Future[dict[str, Guidance] | None]:
        """`read` on a background thread (prefetch the next step's guidance)."""
        return self.reader.read_async(run, step, **kwargs)

    @property
    def fallback_count(self) -> int:
        """How many reads fell back to RTN (missing + corrupt + wrong version)."""
        return self.reader.fallback_count

    @property
    def fallbacks(self) -> dict[str, int]:
        """RTN fallbacks by reason: "missing", "corrupt", "version"."""
        return self.reader.fallbacks

    def read_manifest(self, run: str, step: int, micro_batch: int = 0) -> dict[str, Any]:
        """The verified manifest of a committed entry (raises Missing / Corrupt errors)."""
        return self.reader.read_manifest(run, step, micro_batch)

    def exists(self, run: str, step: int, micro_batch: int = 0) -> bool:
        """Whether the entry is committed."""
        return self.reader.exists(run, step, micro_batch)

    def wait(self, run: str, step: int, micro_batch: int = 0, *, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the entry to be committed; returns whether it is."""
        return self.reader.wait(run, step, micro_batch, timeout_s=timeout_s)

    # ---- policy-version handshake: `PolicyVersions` --------------------------------------------

    def publish_version(self, run: str, version: int) -> None:
        """Trainer: records that run `run` is now at policy `version` (never moves backwards)."""
        self.versions.publish(run, version)

    def published_version(self, run: str) -> int | None:
        """The policy version the trainer published for `run` (None before the first)."""
        return self.versions.published(run)

    def wait_for_version(self, run: str, at_least: int, *, timeout_s: float) -> int:
        """Rollout: waits until the published version is >= `at_least`; returns it (raises
        `TimeoutError` naming the run and the versions)."""
        return self.versions.wait_for(run, at_least, timeout_s=timeout_s)

    # ---- listing and garbage collection: `GarbageCollector` ------------------------------------

    def entries(self, run: str) -> list[tuple[int, int]]:
        """Committed entries of `run` as sorted (step, micro_batch) pairs."""
        return self.collector.entries(run)

    def gc(self, run: str, up_to_step: int) -> list[tuple[int, int]]:
        """Deletes every entry of `run` with step <= `up_to_step` (consumed); returns them."""
        return self.collector.collect(run, up_to_step)

    def discard_from(self, run: str, step: int) -> list[tuple[int, int]]:
        """Deletes every entry of `run` with step >= `step` (a resumed run samples them again);
        returns them."""
        return self.collector.discard_from(run, step)
