"""`GuidanceStoreConfig`: where guidance is stored and how it is written and read; `Fallback`."""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from typing import Any


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
