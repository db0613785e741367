"""The guidance store on object storage: "s3://" through tensorstore's s3 driver against a real
local S3-compatible server (`tests.s3_server`). Entries round-trip bit for bit; damage done to the
objects behind the store's back (boto3) is detected by `read` and by `read_async` (the trainer's
background read); stale versions are refused; the create-if-absent commit holds between two
writers; gc deletes the objects."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tests.guidance.support import RUN, assert_same_guidance, numpy_guidance
from trace_jax.guidance import (
    GuidanceCorruptError,
    GuidanceError,
    GuidanceExistsError,
    GuidanceMissingError,
    GuidanceStore,
    GuidanceStoreConfig,
    GuidanceVersionError,
    S3Options,
)

_prefixes = itertools.count()


def s3_store(server, **overrides) -> tuple[GuidanceStore, str]:
    """A store under a fresh prefix of the server's bucket; (store, its key prefix)."""
    prefix = f"store{next(_prefixes)}/"
    config = GuidanceStoreConfig(
        kvstore=f"s3://{server.bucket}/{prefix}",
        s3=S3Options(endpoint=server.endpoint, region="us-east-1", credentials="environment"),
        poll_s=0.005,
        **overrides,
    )
    return GuidanceStore(config), prefix


def shard_key(server, prefix: str, step: int, site: str, leaf: str) -> str:
    """The object key of the one shard of a leaf of entry (RUN, step, 0)."""
    entry = f"{prefix}{RUN}/step_{step:010d}/mb_00000/"
    leaf_dir = f"/{site.replace('/', '%2F')}/{leaf}/"
    (key,) = [k for k in server.keys(entry) if leaf_dir in k and not k.endswith("/zarr.json")]
    return key


def test_round_trip_bit_for_bit(s3_server, rollout_guidance):
    """NVFP4 and MXFP4 guidance, compact and full, from the real quantizer: stored as S3
    objects and read back whole, or placed by a sharding over 4 devices."""
    store, prefix = s3_store(s3_server)
    with store:
        result = store.write(RUN, 3, rollout_guidance, policy_version=2)
        assert result.nbytes > 0
        keys = s3_server.keys(prefix)
        assert f"{prefix}{RUN}/step_0000000003/mb_00000/manifest.json" in keys
        assert any(k.endswith("/3%2Fv/payload/zarr.json") for k in keys)
        assert_same_guidance(rollout_guidance, store.read(RUN, 3, expected_version=2))

        mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
        sharding = NamedSharding(mesh, PartitionSpec("data"))
        host = numpy_guidance(7, rows=8)
        store.write(RUN, 4, host, policy_version=2)
        placed = store.read(RUN, 4, expected_version=2, sharding=sharding)
        assert_same_guidance(host, placed)
        payload = placed["20/k"].payload
        assert payload.sharding.is_equivalent_to(sharding, payload.ndim)
        assert store.entries(RUN) == [(3, 0), (4, 0)]


def test_damage_is_detected_by_read_and_background_read(s3_server):
    store, prefix = s3_store(s3_server)
    with store:
        for step in range(3):
            store.write(RUN, step, numpy_guidance(step), policy_version=0)
        client, bucket = s3_server.client, s3_server.bucket

        # 1. Bytes of a shard object overwritten: its inner chunk's crc32c fails.
        key = shard_key(s3_server, prefix, 0, "20/k", "payload")
        raw = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        raw[3] ^= 0x5A
        client.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
        # 2. A shard object deleted (zarr would otherwise read the fill value).
        client.delete_object(Bucket=bucket, Key=shard_key(s3_server, prefix, 1, "20/k", "mask"))
        # 3. The manifest deleted: the entry is gone.
        manifest = f"{prefix}{RUN}/step_0000000002/mb_00000/manifest.json"
        client.delete_object(Bucket=bucket, Key=manifest)

        expected = [
            (GuidanceCorruptError, r"step=0.*20%2Fk/payload.*DATA_LOSS"),
            (GuidanceCorruptError, r"step=1.*20%2Fk/mask.*NOT_FOUND"),
            (GuidanceMissingError, r"step=2.*manifest.json' is absent"),
        ]
        for step, (error, match) in enumerate(expected):
            with pytest.raises(error, match=match):
                store.read(RUN, step, expected_version=0)
            with pytest.raises(error, match=match):
                store.read_async(RUN, step, expected_version=0).result(timeout=30)
        # The counted RTN fallback, when asked for, from the background read too.
        assert store.read_async(RUN, 0, expected_version=0, fallback="rtn").result(30) is None
        assert store.read(RUN, 1, expected_version=0, fallback="rtn") is None
        assert store.fallbacks == {"corrupt": 2}


def test_stale_versions_are_refused(s3_server):
    store, _ = s3_store(s3_server, max_staleness=1)
    with store:
        store.publish_version(RUN, 3)
        assert store.wait_for_version(RUN, 3, timeout_s=5) == 3
        with pytest.raises(ValueError, match="cannot publish older 2"):
            store.publish_version(RUN, 2)
        store.write(RUN, 0, numpy_guidance(0), policy_version=1)
        with pytest.raises(GuidanceVersionError, match=r"policy version 1.*expects 2\.\.3"):
            store.read(RUN, 0, expected_version=3)
        with pytest.raises(GuidanceVersionError, match="policy version 1"):
            store.read_async(RUN, 0, expected_version=3).result(timeout=30)
        assert store.read(RUN, 0, expected_version=3, fallback="rtn") is None
        assert store.fallbacks == {"version": 1}
        got = store.read_async(RUN, 0, expected_version=3, max_staleness=2).result(timeout=30)
        assert_same_guidance(numpy_guidance(0), got)


def test_one_entry_two_writers_exactly_one_commits_and_gc(s3_server):
    """The commit's create-if-absent is an S3 conditional write (If-None-Match)."""
    first, prefix = s3_store(s3_server)
    config = first.config
    second = GuidanceStore(config)
    a, b = numpy_guidance(1), numpy_guidance(2)
    futures = [s.write_async(RUN, 5, g, policy_version=1) for s, g in ((first, a), (second, b))]
    outcomes = [f.exception(timeout=30) for f in futures]
    assert sum(e is None for e in outcomes) == 1
    assert sum(isinstance(e, GuidanceExistsError) for e in outcomes) == 1
    assert_same_guidance((a, b)[outcomes.index(None)], first.read(RUN, 5, expected_version=1))
    entry = f"{prefix}{RUN}/step_0000000005/mb_00000/"
    assert len({k[len(entry) :].split("/")[0] for k in s3_server.keys(entry + "data_")}) == 1
    loser = (first, second)[outcomes.index(None) ^ 1]
    with pytest.raises(GuidanceError, match=r"already committed|another writer"):
        loser.flush()
    first.close()
    second.close()

    with GuidanceStore(config) as store:
        store.write(RUN, 6, numpy_guidance(3), policy_version=1)
        assert store.gc(RUN, 5) == [(5, 0)]
        assert store.entries(RUN) == [(6, 0)]
        assert s3_server.keys(entry) == []
