"""GuidanceStoreConfig: kvstore specs, validation, and a URL kvstore with zstd and tiny chunks."""

from __future__ import annotations

import os

import pytest

from tests.guidance.support import RUN, assert_same_guidance, numpy_guidance
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig


def test_config():
    cfg = GuidanceStoreConfig()
    assert cfg.kvstore_spec() == {"driver": "file", "path": os.path.abspath("guidance_store") + "/"}
    assert GuidanceStoreConfig(kvstore="gs://bucket/g/").kvstore_spec() == "gs://bucket/g/"
    spec = {"driver": "s3", "bucket": "b", "path": "g/"}
    assert GuidanceStoreConfig(kvstore=spec).kvstore_spec() == spec
    with pytest.raises(ValueError, match="rtm"):
        GuidanceStoreConfig(fallback="rtm")
    with pytest.raises(ValueError, match="driver"):
        GuidanceStoreConfig(kvstore={"path": "x"})
    # A URL kvstore works like a spec; zstd-compressed, tiny inner chunks round-trip too.
    config = GuidanceStoreConfig(kvstore="memory://", zstd_level=3, inner_chunk_bytes=8)
    with GuidanceStore(config) as store:
        store.write(RUN, 0, numpy_guidance(0), policy_version=0)
        assert store.entries(RUN) == [(0, 0)]
        assert_same_guidance(numpy_guidance(0), store.read(RUN, 0, expected_version=0))
