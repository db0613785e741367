"""Guidance store: rollout guidance from the rollout to the trainer through tensorstore (SPEC 5).

Modules, each importing only those listed before it:

- `errors`, `layout`, `config`: error types; keys, zarr3 specs, manifests; `GuidanceStoreConfig`
  (a local directory, an object store URL such as "s3://bucket/prefix/" with `S3Options`, or a
  tensorstore spec).
- `kvstore`: the open kvstore; kvstore failures as guidance errors.
- `shards`: which process writes and reads which stored shard of a global array (multi-process).
- `versions`: the policy-version handshake and the staleness rule.
- `writer`, `reader`, `gc`: asynchronous committed writes; verified reads; listing and deletion.
- `store`: `GuidanceStore`, the parts above over one kvstore.
"""

from trace_jax.guidance.config import Fallback, GuidanceStoreConfig, S3Options
from trace_jax.guidance.errors import (
    GuidanceCorruptError,
    GuidanceError,
    GuidanceExistsError,
    GuidanceIOError,
    GuidanceMissingError,
    GuidanceVersionError,
)
from trace_jax.guidance.gc import GarbageCollector
from trace_jax.guidance.layout import EntryKey
from trace_jax.guidance.reader import GuidanceReader
from trace_jax.guidance.store import GuidanceStore
from trace_jax.guidance.versions import PolicyVersions
from trace_jax.guidance.writer import GuidanceWriter, WriteResult

__all__ = [
    "EntryKey",
    "Fallback",
    "GarbageCollector",
    "GuidanceCorruptError",
    "GuidanceError",
    "GuidanceExistsError",
    "GuidanceIOError",
    "GuidanceMissingError",
    "GuidanceReader",
    "GuidanceStore",
    "GuidanceStoreConfig",
    "GuidanceVersionError",
    "GuidanceWriter",
    "PolicyVersions",
    "S3Options",
    "WriteResult",
]
