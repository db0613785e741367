"""GuidanceStoreConfig: kvstore paths, URLs and spec dicts, S3 options, validation, and a URL
kvstore with zstd and tiny chunks."""

from __future__ import annotations

import os

import pytest

from tests.guidance.support import RUN, assert_same_guidance, numpy_guidance
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig, S3Options


def test_config():
    cfg = GuidanceStoreConfig()
    assert cfg.kvstore_spec() == {"driver": "file", "path": os.path.abspath("guidance_store") + "/"}
    spec = {"driver": "s3", "bucket": "bucket", "path": "g/"}
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


def test_urls_become_specs():
    def spec(url, **kw):
        return GuidanceStoreConfig(kvstore=url, **kw).kvstore_spec()

    assert spec("s3://guidance-bucket/runs/a") == {
        "driver": "s3",
        "bucket": "guidance-bucket",
        "path": "runs/a/",
    }
    assert spec("gs://my_bucket/g/") == {"driver": "gcs", "bucket": "my_bucket", "path": "g/"}
    assert spec("s3://guidance-bucket") == {"driver": "s3", "bucket": "guidance-bucket", "path": ""}
    assert spec("file:///tmp/g") == {"driver": "file", "path": "/tmp/g/"}
    assert spec("memory://a/b") == {"driver": "memory", "path": "a/b/"}
    s3 = S3Options(endpoint="http://127.0.0.1:9000", region="us-east-1", credentials="environment")
    assert spec("s3://guidance-bucket/g/", s3=s3) == {
        "driver": "s3",
        "bucket": "guidance-bucket",
        "path": "g/",
        "endpoint": "http://127.0.0.1:9000",
        "aws_region": "us-east-1",
        "aws_credentials": {"type": "environment"},
        "use_conditional_write": True,
    }
    # S3 options as a plain dict (an ml_collections config) become S3Options.
    as_dict = GuidanceStoreConfig(kvstore="s3://guidance-bucket/", s3={"credentials": "anonymous"})
    assert as_dict.s3 == S3Options(credentials="anonymous")


@pytest.mark.parametrize(
    ("kvstore", "s3", "match"),
    [
        ("s3://b/g/", None, r"bucket 'b' is not a valid s3:// bucket"),
        ("s3://Guidance/g/", None, r"bucket 'Guidance'"),
        ("s3:///g/", None, r"bucket ''"),
        ("s3://guidance-bucket//g/", None, "empty, '.' or '..' component"),
        ("s3://guidance-bucket/../g/", None, "empty, '.' or '..' component"),
        ("s3://guidance-bucket/g?x=1", None, "no '\\?', '#', '|'"),
        ("http://host/g/", None, "scheme must be one of"),
        ("file://host/g/", None, "file:///absolute/dir/"),
        ({"driver": "s3", "path": "g/"}, None, r"bucket None"),
        ({"driver": "s3", "bucket": "abc", "endpoint": "127.0.0.1:9000"}, None, "http\\(s\\)://"),
        ("gs://guidance-bucket/g/", S3Options(), "applies to an 's3://' kvstore"),
        ({"driver": "s3", "bucket": "abc"}, S3Options(), "carries its own fields"),
        ("s3://abc/", {"endpoint": "ftp://host"}, "http\\(s\\)://host"),
        ("s3://abc/", {"credentials": "keys"}, "credentials must be one of"),
        ("s3://abc/", {"credentials": {"profile": "x"}}, "needs a 'type'"),
    ],
)
def test_malformed_kvstores_are_refused(kvstore, s3, match):
    with pytest.raises(ValueError, match=match):
        GuidanceStoreConfig(kvstore=kvstore, s3=s3)


def test_tensorstore_checks_the_rest_of_a_spec():
    with pytest.raises(ValueError, match=r"not a valid tensorstore kvstore spec.*colour"):
        GuidanceStore(GuidanceStoreConfig(kvstore={"driver": "memory", "colour": "red"}))
