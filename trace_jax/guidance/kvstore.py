"""The tensorstore kvstore under the guidance store: opening it, turning its failures into guidance
errors, and removing the empty directories a file kvstore leaves after deletes."""

from __future__ import annotations

import dataclasses
import os

import tensorstore as ts

from trace_jax.guidance.config import GuidanceStoreConfig
from trace_jax.guidance.errors import GuidanceCorruptError, GuidanceIOError
from trace_jax.guidance.layout import EntryKey

# tensorstore status codes that, for a committed entry, mean its stored data is damaged.
_CORRUPT_CODES = (
    "DATA_LOSS",
    "NOT_FOUND",
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "OUT_OF_RANGE",
)


@dataclasses.dataclass(frozen=True)
class Kv:
    """An open kvstore (its path ends in '/') and the tensorstore context its arrays open in."""

    store: ts.KvStore
    context: ts.Context

    @classmethod
    def open(cls, config: GuidanceStoreConfig) -> Kv:
        """Opens `config.kvstore`; `config.durable` turns on fsync of every written file."""
        context = ts.Context({"file_io_sync": bool(config.durable)})
        spec = config.kvstore_spec()
        try:
            store = ts.KvStore.open(spec, context=context).result()
        except ValueError as e:  # tensorstore's own check of the spec's fields
            raise ValueError(f"kvstore {spec} is not a valid tensorstore kvstore spec: {e}") from e
        if store.path and not store.path.endswith("/"):
            store.path = store.path + "/"
        return cls(store, context)

    def open_zarr3(
        self, path: str, *, create: bool = False, assume_metadata: bool = False, **spec
    ) -> ts.Future:
        """Opens the zarr3 array under `path` of this kvstore in its context, or with `create`
        creates it (failing if it exists), or with `assume_metadata` opens it as `spec`'s
        metadata describes it, whether or not its zarr.json exists yet (neither read nor
        written); `spec`: more of its tensorstore spec."""
        return ts.open(
            {"driver": "zarr3", **spec},
            kvstore=self.store / path,
            open=not create,
            create=create,
            assume_metadata=assume_metadata,
            context=self.context,
        )

    def file_root(self) -> str | None:
        """The directory of a file kvstore (None for any other driver)."""
        spec = self.store.spec().to_json()
        return spec["path"] if spec.get("driver") == "file" else None

    def prune_dirs(self, prefix: str) -> None:
        """The file driver leaves empty directories after `delete_range`: remove those under
        `prefix` (only ever a collected step or a failed write's own data directory)."""
        root = self.file_root()
        if root is None:
            return
        top = os.path.join(root, prefix)
        for dirpath, _, _ in sorted(os.walk(top), reverse=True):  # children before parents
            try:
                os.rmdir(dirpath)  # only succeeds when empty
            except OSError:
                pass


def kv_call(future, where):
    """Result of a kvstore future; failures become `GuidanceIOError` naming `where`."""
    try:
        return future.result()
    except Exception as e:
        raise GuidanceIOError(f"{where}: kvstore operation failed: {e}") from e


def ts_call(future, key: EntryKey, path: str):
    """Result of a zarr3 open/read of a committed entry; damage -> `GuidanceCorruptError`."""
    try:
        return future.result()
    except Exception as e:
        if str(e).startswith(_CORRUPT_CODES):
            raise GuidanceCorruptError(f"{key}: {path!r}: {e}") from e
        raise GuidanceIOError(f"{key}: {path!r}: {e}") from e
