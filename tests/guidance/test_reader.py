"""GuidanceReader: damaged entries are detected and never used, missing entries raise or fall back
to RTN (counted), and an entry is read back bit for bit."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.guidance.support import (
    RUN,
    assert_same_guidance,
    capture,
    file_store,
    numpy_guidance,
    shard_file,
)
from trace_jax.fp4 import Guidance
from trace_jax.guidance import GuidanceCorruptError, GuidanceMissingError, GuidanceStore


def test_round_trip_in_memory(rollout_guidance):
    with GuidanceStore.in_memory() as store:
        result = store.write(RUN, 7, rollout_guidance, policy_version=3, micro_batch=2)
        assert result.nbytes == sum(g.nbytes for g in rollout_guidance.values()) + sum(
            g.mask.size for g in rollout_guidance.values() if g.mask is not None
        )
        got = store.read(RUN, 7, micro_batch=2, expected_version=3)
        assert_same_guidance(rollout_guidance, got)
        assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(got))
        # A subset of sites.
        sub = store.read(RUN, 7, micro_batch=2, expected_version=3, sites=["3/k"])
        assert list(sub) == ["3/k"]
        assert store.entries(RUN) == [(7, 2)]
        assert store.read_manifest(RUN, 7, 2)["policy_version"] == 3
        prefetched = store.read_async(RUN, 7, micro_batch=2, expected_version=3)
        assert_same_guidance(rollout_guidance, prefetched.result(timeout=30))


def test_corruption_is_detected_not_used(tmp_path):
    with file_store(tmp_path) as store:
        for step in range(4):
            store.write(RUN, step, numpy_guidance(step), policy_version=0)

        # 1. A flipped byte inside an inner chunk: the chunk's crc32c fails.
        shard = shard_file(tmp_path, 0, "20/k", "payload")
        raw = bytearray(shard.read_bytes())
        raw[3] ^= 0x5A
        shard.write_bytes(bytes(raw))
        with pytest.raises(GuidanceCorruptError, match=r"step=0.*20%2Fk/payload.*DATA_LOSS"):
            store.read(RUN, 0, expected_version=0)

        # 2. A flipped byte in the shard index (at the end of the shard file).
        shard = shard_file(tmp_path, 1, "20/expert_in", "scales")
        raw = bytearray(shard.read_bytes())
        raw[-6] ^= 0x01
        shard.write_bytes(bytes(raw))
        with pytest.raises(GuidanceCorruptError, match="step=1"):
            store.read(RUN, 1, expected_version=0)

        # 3. A valid shard swapped in from another entry: caught end to end by the leaf crc32.
        shard_file(tmp_path, 2, "20/k", "payload").write_bytes(
            shard_file(tmp_path, 3, "20/k", "payload").read_bytes()
        )
        with pytest.raises(GuidanceCorruptError, match="crc32"):
            store.read(RUN, 2, expected_version=0)

        # 4. A deleted shard (zarr would otherwise read the fill value).
        shard_file(tmp_path, 3, "20/k", "mask").unlink()
        with pytest.raises(GuidanceCorruptError, match="NOT_FOUND"):
            store.read(RUN, 3, expected_version=0)

        # 5. An edited manifest (version bumped by hand): its digest fails.
        store.write(RUN, 4, numpy_guidance(4), policy_version=0)
        manifest = tmp_path / RUN / "step_0000000004" / "mb_00000" / "manifest.json"
        manifest.write_text(
            manifest.read_text().replace('"policy_version": 0', '"policy_version": 1')
        )
        with pytest.raises(GuidanceCorruptError, match=r"manifest.*digest"):
            store.read(RUN, 4, expected_version=1)

        # The counted RTN fallback, when asked for.
        assert store.read(RUN, 0, expected_version=0, fallback="rtn") is None
        assert store.fallback_count == 1 and store.fallbacks == {"corrupt": 1}


def test_missing_raises_or_falls_back_counted():
    store = GuidanceStore.in_memory(fallback="rtn")
    with pytest.raises(GuidanceMissingError, match=r"run='run-a', step=3, micro_batch=1"):
        store.read(RUN, 3, micro_batch=1, expected_version=0, fallback="error")
    t0 = time.perf_counter()
    assert store.read(RUN, 3, micro_batch=1, expected_version=0, timeout_s=0.1) is None
    assert time.perf_counter() - t0 >= 0.1
    store.write(RUN, 3, numpy_guidance(0), policy_version=0)
    with pytest.raises(GuidanceMissingError, match=r"no guidance for sites \['9/k'\]"):
        store.read(RUN, 3, expected_version=0, sites=["9/k"], fallback="error")
    assert store.read(RUN, 3, expected_version=0, sites=["9/k"]) is None
    assert store.fallback_count == 2 and store.fallbacks == {"missing": 2}
    assert store.read(RUN, 3, expected_version=0) is not None
    assert store.fallback_count == 2
    store.close()


def degenerate_guidance() -> dict[str, Guidance]:
    """Guidance whose stored blocks are all zeros or NaN, or that has one row or none: for each
    FP4 format and mode, the capture of `[16, 256]` rows of which the first eight are zero, one
    holds NaN and one Inf, and its slices."""
    x = jax.random.normal(jax.random.key(5), (16, 256)).at[:8].set(0.0)
    x = x.at[9, 7].set(jnp.nan).at[10, 200].set(jnp.inf)
    out = {}
    for fmt in ("nvfp4", "mxfp4"):
        for mode in ("compact", "full"):
            g = capture(x, fmt=fmt, mode=mode)

            def rows(sl, g=g):
                return jax.tree.map(lambda a: a[sl], g)

            out[f"half_zero/{fmt}_{mode}"] = g  # whole inner chunks of zeros (256-byte chunks)
            out[f"zeros/{fmt}_{mode}"] = rows(slice(0, 4))  # an all-zero activation
            out[f"masked/{fmt}_{mode}"] = dataclasses.replace(g, mask=jnp.zeros(16, bool))
            out[f"nan/{fmt}_{mode}"] = rows(slice(8, 12))  # NaN block scales
            out[f"one_row/{fmt}_{mode}"] = rows(slice(11, 12))
            out[f"empty/{fmt}_{mode}"] = rows(slice(0, 0))
    return out


def test_degenerate_entries_read_back_and_a_deleted_chunk_is_corrupt(tmp_path):
    """An entry is readable iff its write committed, whatever its values: blocks equal to the
    zarr fill value (zeros, an all-False mask) are stored too, so a deleted one is damage."""
    guidance = degenerate_guidance()
    assert np.isnan(np.asarray(guidance["nan/mxfp4_full"].scales, np.float32)).any()
    with file_store(tmp_path, inner_chunk_bytes=256) as store:
        for step in (0, 1):
            store.write(RUN, step, guidance, policy_version=0)
        assert_same_guidance(guidance, store.read(RUN, 0, expected_version=0))
        shard_file(tmp_path, 1, "zeros/mxfp4_full", "payload").unlink()
        with pytest.raises(GuidanceCorruptError, match=r"zeros%2Fmxfp4_full/payload.*NOT_FOUND"):
            store.read(RUN, 1, expected_version=0)


def test_an_entry_with_slash_separated_chunk_keys_reads_back(tmp_path, monkeypatch):
    """Entries whose shards sit at zarr3's default keys ("c/0/0", one directory per level, as
    written before the "." keys) read back bit for bit: readers follow each array's zarr.json."""
    from trace_jax.guidance import layout

    slash = {"name": "default", "configuration": {"separator": "/"}}
    monkeypatch.setattr(layout, "CHUNK_KEY_ENCODING", slash)
    want = numpy_guidance(0)
    with file_store(tmp_path) as store:
        store.write(RUN, 0, want, policy_version=0)
    leaf = shard_file(tmp_path, 0, "20/k", "payload")
    assert leaf.name == "c" and leaf.is_dir()  # the "/" layout was written
    monkeypatch.undo()
    with file_store(tmp_path) as store:
        assert_same_guidance(want, store.read(RUN, 0, expected_version=0))
