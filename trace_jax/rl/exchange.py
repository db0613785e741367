"""The exchange: one tensorstore kvstore through which the two jobs of a disaggregated run
(`trace_jax.rl.disaggregated`) pass each other everything, so that they need no shared disk.

  exchange = Exchange.at("s3://bucket/run1/", s3_endpoint="http://minio:9000")
  exchange.write_arrays("rollouts/3/", {"tokens": tokens, ...}, meta={"step": 3})
  meta, arrays = exchange.read_arrays("rollouts/3/")   # verified against its manifest

A location is what the guidance store takes (`GuidanceStoreConfig.kvstore`, parsed there): a
directory, "s3://bucket/prefix/" (with `S3Options`), "gs://bucket/prefix/", "file:///dir/", or a
tensorstore kvstore spec dict; it opens through the store's kvstore wrapper (`Kv`). It holds:

* bundles: named host arrays written together under a prefix ending in '/'. Each array is one
  object `<prefix>data_<token>/<i>` (its bytes in C order); the bundle commits when its manifest
  `<prefix>manifest.json` is created, last and conditionally (create-if-absent), so a reader sees
  all of a bundle or none of it and of two writers one commits. The manifest records each
  array's name, shape, dtype, size and crc32, and its own crc32: `read_arrays` checks them all.
* JSON records (heartbeats), each replaced whole by a write (an S3 PUT, the file driver's
  rename).

Policies travel as bundles too, not as orbax checkpoints: orbax does its directory work through
epath (s3fs for "s3://") and derives its tensorstore spec from the path alone, so it cannot reach
an S3-compatible endpoint; one object per array works on every kvstore driver.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
import zlib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from trace_jax.guidance import GuidanceStoreConfig, S3Options
from trace_jax.guidance.kvstore import Kv
from trace_jax.guidance.layout import crc32, prefix_range_end

SCHEMA = "trace-jax/exchange-bundle/1"
MANIFEST = "manifest.json"

log = logging.getLogger(__name__)


class ExchangeError(RuntimeError):
    """Something could not be written to or read from the exchange as asked."""


class ExchangeMissingError(ExchangeError):
    """No bundle is committed at the prefix (not yet written, or deleted)."""


class ExchangeCorruptError(ExchangeError):
    """A committed bundle or a record fails its checks (checksum, size, missing object)."""


class ExchangeExistsError(ExchangeError):
    """A bundle is committed at the prefix already."""


class ExchangeIOError(ExchangeError):
    """The kvstore failed in a way that says nothing about the data (e.g. unreachable)."""


def location_config(
    location: str,
    *,
    s3_endpoint: str = "",
    s3_region: str = "",
    s3_credentials: str = "default",
) -> GuidanceStoreConfig:
    """The kvstore config of an exchange `location` (a directory, "" the current one, or a
    URL); the `s3_*` settings (`S3Options`' fields, "" for unset) apply to an "s3://" location
    only. Raises ValueError naming a malformed location or misplaced S3 settings."""
    s3_given = bool(s3_endpoint or s3_region or s3_credentials != "default")
    if s3_given and not location.startswith("s3://"):
        raise ValueError(
            f"S3 settings (endpoint {s3_endpoint!r}, region {s3_region!r}, credentials "
            f"{s3_credentials!r}) apply to an 's3://' exchange, got exchange {location!r}"
        )
    s3 = None
    if s3_given:
        s3 = S3Options(
            endpoint=s3_endpoint or None, region=s3_region or None, credentials=s3_credentials
        )
    return GuidanceStoreConfig(kvstore=location or os.curdir, s3=s3)


def manifest_key(prefix: str) -> str:
    """The key whose creation commits the bundle at `prefix`."""
    return _check_prefix(prefix) + MANIFEST


def _check_prefix(prefix: str) -> str:
    if not prefix.endswith("/") or prefix.startswith("/"):
        raise ValueError(f"a bundle prefix is relative and ends in '/', got {prefix!r}")
    return prefix


def _result(future, where: str):
    """A kvstore future's result; its failure becomes ExchangeIOError naming `where`."""
    try:
        return future.result()
    except Exception as e:
        raise ExchangeIOError(f"{where}: kvstore operation failed: {e}") from e


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class Exchange:
    """An open exchange location (module docstring). Thread-safe, as tensorstore's kvstore is.

    Attributes: config (its `GuidanceStoreConfig`), url (where it is, for messages:
    "s3://bucket/prefix/", "file:///dir/").
    """

    def __init__(self, config: GuidanceStoreConfig):
        self.config = config
        self._kv = Kv.open(config)
        try:
            self.url = self._kv.store.url
        except NotImplementedError:  # tensorstore has no URL for an S3 store with an endpoint
            spec = self._kv.store.spec().to_json()
            self.url = f"{spec['driver']}://{spec.get('bucket', '')}/{self._kv.store.path}"

    @classmethod
    def at(cls, location: str, **s3: str) -> Exchange:
        """The exchange at `location`, `s3` being `location_config`'s S3 settings."""
        return cls(location_config(location, **s3))

    def where(self, key: str) -> str:
        """`key`'s location as a URL."""
        return self.url + key

    def sub_config(self, prefix: str) -> GuidanceStoreConfig:
        """A kvstore config of the location under `prefix` (the guidance store's, say)."""
        spec = ts.KvStore.Spec(self.config.kvstore_spec()) / _check_prefix(prefix)
        return GuidanceStoreConfig(kvstore=spec.to_json())

    # ---- records ------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return _result(self._kv.store.read(key), self.where(key)).state == "value"

    def read_json(self, key: str) -> dict | None:
        """The JSON object at `key` (None if there is none)."""
        got = _result(self._kv.store.read(key), self.where(key))
        if got.state != "value":
            return None
        try:
            return json.loads(got.value)
        except ValueError as e:
            raise ExchangeCorruptError(f"{self.where(key)} is not a JSON record: {e}") from None

    def write_json(self, key: str, record: Mapping[str, Any]) -> None:
        """Replaces the record at `key` whole."""
        _result(self._kv.store.write(key, json.dumps(record).encode()), self.where(key))

    # ---- bundles ------------------------------------------------------------------------------

    def committed(self, prefix: str) -> bool:
        return self.exists(manifest_key(prefix))

    def write_arrays(
        self, prefix: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]
    ) -> None:
        """Writes `arrays` (name -> host array) and commits them as the bundle at `prefix`
        with the JSON values `meta`. Raises ExchangeExistsError if one is committed there."""
        where, key = self.where(prefix), manifest_key(prefix)
        current = _result(self._kv.store.read(key), where)
        if current.state == "value":
            raise ExchangeExistsError(f"{where} holds a committed bundle already ({MANIFEST})")
        # Unique per attempt: a failed or racing writer never overwrites committed data.
        data = f"data_{uuid.uuid4().hex[:16]}/"
        try:
            entries, writes = [], []
            for i, (name, x) in enumerate(arrays.items()):
                x = np.ascontiguousarray(x)
                entries.append(
                    {
                        "name": name,
                        "shape": list(x.shape),
                        "dtype": x.dtype.name,
                        "nbytes": x.nbytes,
                        "crc32": crc32(x),
                    }
                )
                writes.append(self._kv.store.write(f"{prefix}{data}{i}", x.tobytes()))
            for w in writes:
                _result(w, where)
            body = {
                "schema": SCHEMA,
                "meta": dict(meta),
                "data": data,
                "arrays": entries,
                "writer": {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()},
            }
            manifest = {"body": body, "crc32": zlib.crc32(_canonical(body))}
            done = _result(
                self._kv.store.write(
                    key, json.dumps(manifest).encode(), if_equal=current.stamp.generation
                ),
                where,
            )
            if not done.generation:  # the create-if-absent condition failed
                raise ExchangeExistsError(f"{where} was committed by another writer meanwhile")
        except BaseException:
            try:  # best effort: without a manifest the data is unreachable anyway
                self._delete_range(prefix + data)
            except ExchangeError as e:
                log.warning("could not delete the uncommitted objects %s: %s", where + data, e)
            raise

    def read_arrays(self, prefix: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(meta, name -> read-only host array) of the bundle committed at `prefix`, each array
        checked against its manifest. Raises ExchangeMissingError when none is committed,
        ExchangeCorruptError naming the bundle, the array and its object when one fails."""
        where = self.where(prefix)
        got = _result(self._kv.store.read(manifest_key(prefix)), where)
        if got.state != "value":
            raise ExchangeMissingError(f"no bundle is committed at {where} (no {MANIFEST})")
        body = self._decode_manifest(got.value, where)
        keys = [f"{prefix}{body['data']}{i}" for i in range(len(body["arrays"]))]
        reads = [self._kv.store.read(k) for k in keys]
        arrays = {}
        for entry, k, f in zip(body["arrays"], keys, reads, strict=True):
            raw = _result(f, self.where(k))
            what = f"{where}: array {entry['name']!r} ({self.where(k)})"
            if raw.state != "value":
                raise ExchangeCorruptError(f"{what} is missing")
            if len(raw.value) != entry["nbytes"]:
                raise ExchangeCorruptError(
                    f"{what} holds {len(raw.value)} bytes; its manifest records {entry['nbytes']}"
                )
            x = np.frombuffer(raw.value, jnp.dtype(entry["dtype"])).reshape(entry["shape"])
            if (crc := crc32(x)) != entry["crc32"]:
                raise ExchangeCorruptError(
                    f"{what} fails its checksum: crc32 {crc:08x}, its manifest records "
                    f"{entry['crc32']:08x}"
                )
            arrays[entry["name"]] = x
        return body["meta"], arrays

    def delete(self, prefix: str) -> None:
        """Deletes the bundle at `prefix`, its manifest first (no reader sees it committed
        with objects gone), then everything under `prefix`."""
        _result(self._kv.store.write(manifest_key(prefix), None), self.where(prefix))
        self._delete_range(prefix)

    def _delete_range(self, prefix: str) -> None:
        rng = ts.KvStore.KeyRange(prefix, prefix_range_end(prefix))
        _result(self._kv.store.delete_range(rng), self.where(prefix))
        self._kv.prune_dirs(prefix)

    @staticmethod
    def _decode_manifest(raw: bytes, where: str) -> dict[str, Any]:
        try:
            manifest = json.loads(raw)
            body = manifest["body"]
            ok = zlib.crc32(_canonical(body)) == manifest["crc32"] and body["schema"] == SCHEMA
        except (ValueError, KeyError, TypeError) as e:
            raise ExchangeCorruptError(f"{where}{MANIFEST} is unreadable: {e!r}") from None
        if not ok:
            raise ExchangeCorruptError(
                f"{where}{MANIFEST} fails its checksum or is not a {SCHEMA} manifest"
            )
        return body
