"""`GuidanceStoreConfig`: where guidance is stored and how it is written and read; `S3Options`
for S3 and S3-compatible servers; `Fallback`.

Where (`GuidanceStoreConfig.kvstore`) is one of

* a local directory: "guidance_store", "/data/run1/guidance" (made absolute);
* a URL: "s3://bucket/prefix/" (with `S3Options` for an S3-compatible server), "gs://bucket/
  prefix/" (Google Cloud Storage, credentials from the environment's application default
  credentials), "file:///abs/dir/", "memory://" (this process only);
* a tensorstore kvstore spec dict, passed through as given (any driver; its own fields).

URLs become tensorstore spec dicts here (`kvstore_spec`), so a malformed one fails when the config
is built, naming what is wrong. "s3://" and "gs://" take the same path (bucket + key prefix); the
tests run "s3://" against a local S3-compatible server, "gs://" is not tested (no server here).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

URL_SCHEMES = ("s3", "gs", "file", "memory")
# The credential providers of tensorstore's s3 driver (its `Context.aws_credentials` types).
AWS_CREDENTIALS = ("default", "environment", "anonymous", "profile", "imds", "ecs")
# Bucket names: S3's rule (3-63 characters); GCS also allows '_' and dotted names up to 222.
_BUCKET_RE = {
    "s3": re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"),
    "gs": re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]"),
}
_DRIVER_SCHEME = {"s3": "s3", "gcs": "gs"}


class Fallback(enum.StrEnum):
    """What `read` does with missing, corrupt or wrong-version guidance."""

    ERROR = "error"  # raise the GuidanceError
    RTN = "rtn"  # return None (the trainer rounds to nearest), count it in `fallback_count`


@dataclasses.dataclass(frozen=True, kw_only=True)
class S3Options:
    """How an "s3://bucket/prefix/" store reaches its server.

    Attributes:
      endpoint: "http(s)://host:port" of an S3-compatible server (MinIO, Ceph, a local test
        server), addressed path-style (`endpoint/bucket/key`); None: AWS's own endpoints.
      region: the region requests are signed for (None: with AWS, the bucket's, looked up; with
        an endpoint, the server's default).
      credentials: where the keys come from: "default" (AWS's chain: environment, profile files,
        ECS, EC2 metadata), "environment" (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
        AWS_SESSION_TOKEN), "anonymous", "profile", "imds", "ecs"; or a full tensorstore
        `aws_credentials` dict ({"type": "profile", "profile": "guidance"}).
      conditional_writes: send If-Match / If-None-Match with writes. The store commits an entry
        by creating its manifest if absent; without conditional writes tensorstore checks and
        writes in two requests, so two writers of one entry could both commit. tensorstore turns
        them on for AWS endpoints by itself; here they are on for any endpoint (MinIO, Ceph and
        R2 support them). Turn off only for a server that rejects them.

    An unreachable endpoint is retried by tensorstore (32 attempts, backoff up to 32 s: minutes)
    before the store raises `GuidanceIOError`.
    """

    endpoint: str | None = None
    region: str | None = None
    credentials: str | Mapping[str, Any] = "default"
    conditional_writes: bool = True

    def __post_init__(self):
        if self.endpoint is not None:
            check_endpoint(self.endpoint)
        if self.region is not None and not re.fullmatch(r"[a-z0-9-]+", str(self.region)):
            raise ValueError(f"S3Options.region must look like 'us-east-1', got {self.region!r}")
        creds = self.credentials
        if isinstance(creds, Mapping):
            if creds.get("type") not in AWS_CREDENTIALS:
                raise ValueError(
                    f"S3Options.credentials dict needs a 'type' in {AWS_CREDENTIALS}, got "
                    f"{dict(creds)}"
                )
        elif creds not in AWS_CREDENTIALS:
            raise ValueError(
                f"S3Options.credentials must be one of {AWS_CREDENTIALS} or a dict, got {creds!r}"
            )

    def spec_fields(self) -> dict[str, Any]:
        """The fields of tensorstore's s3 kvstore spec these options set."""
        creds = self.credentials
        fields: dict[str, Any] = {
            "aws_credentials": dict(creds) if isinstance(creds, Mapping) else {"type": creds},
            "use_conditional_write": self.conditional_writes,
        }
        if self.endpoint is not None:
            fields["endpoint"] = self.endpoint
        if self.region is not None:
            fields["aws_region"] = self.region
        return fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuidanceStoreConfig:
    """Where and how guidance is stored.

    Attributes:
      kvstore: a local directory (default "guidance_store", made absolute), a URL ("s3://bucket/
        dir/", "gs://bucket/dir/", "file:///dir/", "memory://") or a tensorstore kvstore spec
        dict, passed through; see the module docstring.
      s3: `S3Options` (or a dict of its fields) for an "s3://" kvstore; None: AWS defaults.
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
      barrier_timeout_s: how long the processes of a multi-process write wait for each other
        (a process that does not arrive fails the write on all of them).
    """

    kvstore: str | Mapping[str, Any] = "guidance_store"
    s3: S3Options | None = None
    fallback: Fallback = Fallback.ERROR
    max_staleness: int = 0
    max_pending_writes: int = 4
    write_threads: int = 2
    inner_chunk_bytes: int = 1 << 20
    zstd_level: int | None = None
    poll_s: float = 0.02
    durable: bool = False
    barrier_timeout_s: float = 300.0

    def __post_init__(self):
        object.__setattr__(self, "fallback", Fallback(self.fallback))
        if isinstance(self.s3, Mapping):
            object.__setattr__(self, "s3", S3Options(**self.s3))
        if not isinstance(self.kvstore, str | Mapping) or not self.kvstore:
            raise ValueError(f"kvstore must be a path, URL or spec dict, got {self.kvstore!r}")
        self.kvstore_spec()  # a malformed URL or spec fails here
        for name in ("max_pending_writes", "write_threads", "inner_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.zstd_level is not None and not -131072 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in [-131072, 22] or None, got {self.zstd_level}")
        for name in ("poll_s", "barrier_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def kvstore_spec(self) -> dict[str, Any]:
        """The tensorstore kvstore spec: a dict as given, a URL parsed, a plain path as a file
        kvstore. Raises ValueError naming what is malformed."""
        if isinstance(self.kvstore, Mapping):
            spec = dict(self.kvstore)
            check_spec(spec)
            if self.s3 is not None:
                raise ValueError(
                    "GuidanceStoreConfig.s3 applies to an 's3://' URL; a spec dict carries its "
                    f"own fields, got kvstore={spec} and s3={self.s3}"
                )
            return spec
        if "://" not in self.kvstore:
            spec = {"driver": "file", "path": os.path.abspath(self.kvstore) + "/"}
        else:
            spec = parse_url(self.kvstore)
        if self.s3 is not None:
            if spec["driver"] != "s3":
                raise ValueError(
                    f"GuidanceStoreConfig.s3 applies to an 's3://' kvstore, got {self.kvstore!r}"
                )
            spec.update(self.s3.spec_fields())
        return spec


def parse_url(url: str) -> dict[str, Any]:
    """A kvstore URL ("s3://bucket/prefix/", "gs://...", "file:///dir/", "memory://") as a
    tensorstore spec dict; a prefix always ends in '/'. Raises ValueError naming the fault."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme
    if scheme not in URL_SCHEMES:
        raise ValueError(
            f"kvstore URL {url!r}: the scheme must be one of {URL_SCHEMES}; pass a tensorstore "
            "spec dict for another driver"
        )
    if parts.query or parts.fragment or "|" in url:
        raise ValueError(f"kvstore URL {url!r} must be a plain scheme://location, no '?', '#', '|'")
    if scheme in _BUCKET_RE:
        path = parts.path.removeprefix("/")
    elif scheme == "memory":  # "memory://a/b/": the whole location is the prefix
        path = (parts.netloc + parts.path).removeprefix("/")
    else:
        path = parts.path
    if path and not path.endswith("/"):
        path += "/"
    components = (path.removeprefix("/") if scheme == "file" else path).split("/")[:-1]
    if any(c in ("", ".", "..") for c in components):
        raise ValueError(f"kvstore URL {url!r}: its path has an empty, '.' or '..' component")
    if scheme == "memory":
        return {"driver": "memory", "path": path}
    if scheme == "file":
        if parts.netloc or not path.startswith("/"):
            raise ValueError(f"kvstore URL {url!r}: a file URL is file:///absolute/dir/")
        return {"driver": "file", "path": path}
    check_bucket(scheme, parts.netloc, url)
    return {"driver": "s3" if scheme == "s3" else "gcs", "bucket": parts.netloc, "path": path}


def check_bucket(scheme: str, bucket: str, where: str) -> None:
    if not _BUCKET_RE[scheme].fullmatch(bucket or "") or ".." in bucket:
        raise ValueError(
            f"{where}: bucket {bucket!r} is not a valid {scheme}:// bucket name (lower-case "
            "letters, digits, '.', '-'; 3 to 63 characters; starts and ends alphanumeric)"
        )


def check_endpoint(endpoint: str) -> None:
    parts = urllib.parse.urlsplit(endpoint if isinstance(endpoint, str) else "")
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path.strip("/"):
        raise ValueError(f"an S3 endpoint must be 'http(s)://host[:port]', got {endpoint!r}")


def check_spec(spec: dict[str, Any]) -> None:
    """Checks the fields of a spec dict that this module knows (the rest tensorstore checks
    when the store opens)."""
    driver = spec.get("driver")
    if not isinstance(driver, str) or not driver:
        raise ValueError(f"a kvstore spec dict needs a 'driver', got {spec}")
    if driver in _DRIVER_SCHEME:
        check_bucket(_DRIVER_SCHEME[driver], spec.get("bucket"), f"kvstore spec {spec}")
    if driver == "s3" and "endpoint" in spec:
        check_endpoint(spec["endpoint"])
    if driver == "file" and not isinstance(spec.get("path"), str):
        raise ValueError(f"a file kvstore spec needs a 'path', got {spec}")
