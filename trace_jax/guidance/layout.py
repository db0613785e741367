"""On-disk layout of the guidance store: keys, zarr3 array specs, leaf encodings, manifests.

Keys, relative to the store's kvstore root (one entry = one (run, step, micro-batch)):

    <run>/policy_version.json                          trainer's published policy version
    <run>/step_<step:010d>/mb_<mb:05d>/manifest.json   commit marker, written last
    <run>/step_<step:010d>/mb_<mb:05d>/data_<token>/<quoted site>/<leaf>/zarr.json
    <run>/step_<step:010d>/mb_<mb:05d>/data_<token>/<quoted site>/<leaf>/c.<i>. ... .<k>
    <run>/step_<step:010d>/mb_<mb:05d>/data_<token>/parts/<process:05d>.json  (multi-process)

`<leaf>` is one of payload, scales, global_scale, mask (absent leaves are not stored); `<quoted
site>` is the site key ("layer/name") percent-encoded into one path component ("3%2Fk"). Each leaf
is one zarr3 array cut into shards (zarr3 `sharding_indexed`; one object each, `c.<i>. ... .<k>`
at shard grid position (i, ..., k)): a single shard for an array written whole by one process, or
one per jax shard of a global array, so that each process of a multi-process write writes whole
objects of its own (`shards.py`). Shard keys are "."-separated because a file kvstore makes a
directory per "/" level, and creating and deleting directories, not the bytes, dominates the
time an entry takes to write and to collect on a local disk. A shard holds inner chunks of about
`inner_chunk_bytes`, each followed by its crc32c, and a crc32c-protected shard index; the
manifest records each shard's crc32 (C order over the shard grid), so a process that reads some
rows checks exactly the shards it reads. A multi-process write leaves one part record per process
(the crc32s of the shards it wrote), which process 0 folds into the manifest.
`<token>` is unique per write attempt, so racing or retried writers never overwrite each other's
data; the manifest names the token it commits. Step numbers are zero-padded so a step range is a
key range (garbage collection is one `delete_range`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import urllib.parse
import zlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from trace_jax.fp4.formats import BlockFormat

SCHEMA = "trace-jax/guidance/2"
LEAVES = ("payload", "scales", "global_scale", "mask")
MANIFEST = "manifest.json"
VERSION_KEY = "policy_version.json"
MAX_STEP = 10**10 - 1
MAX_MICRO_BATCH = 10**5 - 1
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_run(run: str) -> str:
    """Returns `run` if it is a plain name (letters, digits, '.', '_', '-'), else raises."""
    if not isinstance(run, str) or not _RUN_RE.fullmatch(run):
        raise ValueError(
            f"run must be a name of letters, digits, '.', '_' or '-' (no '/'), got {run!r}"
        )
    return run


def _check_index(name: str, value: int, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= int(value) <= limit:
        raise ValueError(f"{name} must be in [0, {limit}], got {value}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class EntryKey:
    """One guidance entry: the guidance of micro-batch `micro_batch` of training step `step`."""

    run: str
    step: int
    micro_batch: int = 0

    def __post_init__(self):
        check_run(self.run)
        object.__setattr__(self, "step", _check_index("step", self.step, MAX_STEP))
        object.__setattr__(
            self, "micro_batch", _check_index("micro_batch", self.micro_batch, MAX_MICRO_BATCH)
        )

    @property
    def prefix(self) -> str:
        return f"{step_prefix(self.run, self.step)}mb_{self.micro_batch:05d}/"

    @property
    def manifest_key(self) -> str:
        return self.prefix + MANIFEST

    def data_prefix(self, data_dir: str) -> str:
        """The prefix of one write attempt's arrays (`data_dir`: "data_<token>")."""
        return f"{self.prefix}{data_dir}/"

    def leaf_prefix(self, data_dir: str, site_dir: str, leaf: str) -> str:
        """The prefix of one leaf's zarr3 array (`site_dir`: the site's `site_dir`)."""
        return f"{self.data_prefix(data_dir)}{site_dir}/{leaf}/"

    def part_key(self, data_dir: str, process: int) -> str:
        """The part record of process `process` in a multi-process write attempt."""
        return f"{self.data_prefix(data_dir)}parts/{process:05d}.json"

    def __str__(self) -> str:
        return f"guidance[run={self.run!r}, step={self.step}, micro_batch={self.micro_batch}]"


def step_prefix(run: str, step: int) -> str:
    return f"{run}/step_{step:010d}/"


def version_key(run: str) -> str:
    return f"{check_run(run)}/{VERSION_KEY}"


def site_dir(site: str) -> str:
    """The site key as one path component ("3/k" -> "3%2Fk")."""
    return urllib.parse.quote(site, safe="-_.")


def prefix_range_end(prefix: str) -> str:
    """Exclusive upper key of all keys starting with `prefix` (which ends in '/')."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


# ---- leaves ------------------------------------------------------------------------------------

# Stored zarr3 data type per leaf; scales keep their float8 bit patterns as uint8.
STORED_DTYPE = {"payload": "uint8", "scales": "uint8", "global_scale": "float32", "mask": "bool"}


def logical_dtype(leaf: str, fmt: BlockFormat) -> np.dtype:
    return np.dtype(fmt.scale_dtype) if leaf == "scales" else np.dtype(STORED_DTYPE[leaf])


def to_stored(leaf: str, x: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """Host array of a `Guidance` leaf -> the contiguous array stored for it."""
    want = logical_dtype(leaf, fmt)
    if x.dtype != want:
        raise ValueError(f"guidance {leaf} must be {want}, got {x.dtype}")
    x = np.ascontiguousarray(x)
    return x.view(np.uint8) if leaf == "scales" else x


def from_stored(leaf: str, x: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    return x.view(jnp.dtype(fmt.scale_dtype)) if leaf == "scales" else x


def crc32(x: np.ndarray) -> int:
    """crc32 of the array's bytes in C order (end-to-end check, independent of the codecs)."""
    return zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8)) & 0xFFFFFFFF


# ---- zarr3 ------------------------------------------------------------------------------------

# Shard keys "c.0.0.0" in the leaf's directory, not "c/0/0/0" (module docstring). Readers take the
# encoding from each array's zarr.json.
CHUNK_KEY_ENCODING = {"name": "default", "configuration": {"separator": "."}}


def inner_chunk_shape(
    shape: tuple[int, ...], itemsize: int, target_bytes: int, *, divides: bool = False
) -> list[int]:
    """Inner chunk of about `target_bytes`: whole trailing axes, split along the leading ones;
    with `divides`, one that tiles `shape` exactly (the split axis takes a divisor of its size)."""
    chunk = [max(1, d) for d in shape]
    for axis in range(len(chunk)):
        row_bytes = math.prod(chunk[axis + 1 :]) * itemsize  # one index along `axis`
        if row_bytes * chunk[axis] <= target_bytes:
            break
        if row_bytes <= target_bytes:
            rows = max(1, target_bytes // row_bytes)
            if divides:
                rows = next(r for r in range(rows, 0, -1) if chunk[axis] % r == 0)
            chunk[axis] = rows
            break
        chunk[axis] = 1
    return chunk


def array_metadata(
    shape: tuple[int, ...],
    dtype: str,
    *,
    inner_chunk_bytes: int,
    zstd_level: int | None,
    shard_shape: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """zarr3 metadata: shards of `shard_shape` (None: one shard for the whole array), crc32c on
    each inner chunk and on each shard's index."""
    itemsize = np.dtype(dtype).itemsize
    if shard_shape is None:
        inner = inner_chunk_shape(tuple(shape), itemsize, inner_chunk_bytes)
        # One shard covers the whole array; it is rounded up to whole inner chunks (the sharding
        # codec needs them to tile it), and inner chunks past the array's end are never written.
        shard = [-(-max(1, d) // c) * c for d, c in zip(shape, inner, strict=True)]
    else:
        shard = [max(1, d) for d in shard_shape]
        inner = inner_chunk_shape(tuple(shard), itemsize, inner_chunk_bytes, divides=True)
    inner_codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if zstd_level is not None:
        inner_codecs.append({"name": "zstd", "configuration": {"level": zstd_level}})
    inner_codecs.append({"name": "crc32c"})
    return {
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": shard},
        },
        "chunk_key_encoding": CHUNK_KEY_ENCODING,
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": inner,
                    "codecs": inner_codecs,
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    "index_location": "end",
                },
            }
        ],
    }


def shard_grid(shape: tuple[int, ...], shard_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shards per axis (at least one, also along an empty axis)."""
    return tuple(max(1, -(-d // c)) for d, c in zip(shape, shard_shape, strict=True))


def shard_region(
    shape: tuple[int, ...], shard_shape: tuple[int, ...], flat: int
) -> tuple[slice, ...]:
    """The part of the array that shard number `flat` (C order over the grid) covers."""
    cell = np.unravel_index(flat, shard_grid(shape, shard_shape))
    return tuple(
        slice(i * c, min((i + 1) * c, d)) for i, c, d in zip(cell, shard_shape, shape, strict=True)
    )


# ---- manifests --------------------------------------------------------------------------------


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_manifest(body: dict[str, Any]) -> bytes:
    """JSON manifest with a crc32 of its canonical body under "digest"."""
    digest = f"crc32:{zlib.crc32(_canonical(body)) & 0xFFFFFFFF:08x}"
    return json.dumps({**body, "digest": digest}, sort_keys=True, indent=1).encode()


def decode_manifest(raw: bytes) -> dict[str, Any]:
    """Parses and verifies a manifest; raises ValueError saying what is wrong."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"manifest is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or "digest" not in doc:
        raise ValueError("manifest has no digest")
    body = {k: v for k, v in doc.items() if k != "digest"}
    digest = f"crc32:{zlib.crc32(_canonical(body)) & 0xFFFFFFFF:08x}"
    if doc["digest"] != digest:
        raise ValueError(f"manifest digest {doc['digest']!r} != computed {digest!r}")
    if body.get("schema") != SCHEMA:
        raise ValueError(f"manifest schema {body.get('schema')!r}, expected {SCHEMA!r}")
    _check_body(body)
    return body


def _check_body(body: dict[str, Any]) -> None:
    """Structure of a manifest body (what the reader relies on); raises ValueError."""

    def need(doc, field, kind, where="manifest"):
        if not isinstance(doc, dict) or not isinstance(doc.get(field), kind):
            raise ValueError(f"{where} lacks a valid {field!r}")
        return doc[field]

    need(body, "policy_version", int)
    if not re.fullmatch(r"data_[0-9a-f]+", need(body, "data", str)):
        raise ValueError(f"manifest data directory {body['data']!r} is malformed")
    for site, doc in need(body, "sites", dict).items():
        where = f"manifest site {site!r}"
        if need(doc, "dir", str, where) != site_dir(site):
            raise ValueError(f"{where} has directory {doc['dir']!r}, expected {site_dir(site)!r}")
        need(doc, "fmt", str, where)
        need(doc, "mode", str, where)
        need(doc, "shape", list, where)
        for leaf, leaf_doc in need(doc, "leaves", dict, where).items():
            if leaf not in LEAVES or STORED_DTYPE[leaf] != need(leaf_doc, "stored_dtype", str):
                raise ValueError(f"{where} has an unknown leaf {leaf!r} or stored dtype")
            at = f"{where} leaf {leaf!r}"
            shape = need(leaf_doc, "shape", list, at)
            shard = need(leaf_doc, "shard_shape", list, at)
            crcs = need(leaf_doc, "crc32", list, at)
            ok = len(shape) == len(shard) and all(isinstance(c, int) and c >= 1 for c in shard)
            ok = ok and all(isinstance(d, int) and d >= 0 for d in shape)
            ok = ok and all(isinstance(c, int) for c in crcs)
            if not ok or len(crcs) != math.prod(shard_grid(shape, shard)):
                raise ValueError(f"{at} has shard shape {shard} and {len(crcs)} crc32s for {shape}")
