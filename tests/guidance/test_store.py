"""GuidanceStore: round trip, async writes, concurrent writers, integrity, versions, gc, and a
disaggregated rollout / trainer pair of processes linked only by the store."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.fp4 import Guidance, GuidanceMode
from trace_jax.guidance import (
    GuidanceCorruptError,
    GuidanceError,
    GuidanceExistsError,
    GuidanceMissingError,
    GuidanceStore,
    GuidanceStoreConfig,
    GuidanceVersionError,
)
from trace_jax.guidance import store as store_module

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN = "run-a"


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.reshape(-1).view(np.uint8) if x.dtype != np.bool_ else x.reshape(-1)


def assert_same_guidance(a: dict[str, Guidance], b: dict[str, Guidance]) -> None:
    """Same site keys, same static fmt/mode and None-ness, bit-identical leaves and dtypes."""
    assert sorted(a) == sorted(b)
    for site in a:
        ga, gb = a[site], b[site]
        assert jax.tree_util.tree_structure(ga) == jax.tree_util.tree_structure(gb), site
        assert (ga.fmt, ga.mode) == (gb.fmt, gb.mode)
        for la, lb in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
            assert la.shape == lb.shape and jnp.dtype(la.dtype) == jnp.dtype(lb.dtype), site
            np.testing.assert_array_equal(_bits(la), _bits(lb))


def digest(guidance: dict[str, Guidance]) -> int:
    """crc32 over every leaf's bytes, sites in sorted order."""
    crc = 0
    for site in sorted(guidance):
        for leaf in jax.tree.leaves(guidance[site]):
            crc = zlib.crc32(_bits(leaf).tobytes(), crc)
    return crc


def numpy_guidance(seed: int, rows: int = 4, n: int = 64) -> dict[str, Guidance]:
    """Random but well-formed host guidance (no jax computation): MXFP4 compact, NVFP4 full."""
    rng = np.random.default_rng(seed)
    e8m0 = np.dtype(fp4.MXFP4.scale_dtype)
    e4m3 = np.dtype(fp4.NVFP4.scale_dtype)
    compact = Guidance(
        rng.integers(0, 256, (rows, n // 8), dtype=np.uint8),
        rng.integers(120, 130, (rows, n // 32), dtype=np.uint8).view(e8m0),
        None,
        None,
        fp4.MXFP4,
        GuidanceMode.COMPACT,
    )
    full = Guidance(
        rng.integers(0, 256, (rows, n // 2), dtype=np.uint8),
        rng.integers(40, 80, (rows, n // 16), dtype=np.uint8).view(e4m3),
        rng.random((rows, 1), dtype=np.float32),
        rng.random(rows) < 0.7,
        fp4.NVFP4,
        GuidanceMode.FULL,
    )
    return {"20/expert_in": compact, "20/k": full}


@functools.partial(jax.jit, static_argnames=("fmt", "mode", "global_axes"))
def capture(x, mask=None, *, fmt, mode, global_axes=(-1,)):
    """The rollout's capture: real quantization, then guidance (jitted: compiles fast)."""
    return fp4.make_guidance(fp4.quantize(x, fmt, global_axes=global_axes), mode, mask=mask)


@pytest.fixture(scope="module")
def rollout_guidance() -> dict[str, Guidance]:
    """Realistic guidance from the real quantizer: [B, T, ...] rows like the sampler's."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x_kv = jax.random.normal(k1, (2, 5, 2, 64)) * 3.0  # [B, T, H, Dh]
    x_act = jax.random.normal(k2, (2, 5, 128))  # [B, T, D]
    mask = jax.random.uniform(k3, (2, 5, 2)) < 0.6
    return {
        "3/k": capture(x_kv, mask, fmt="nvfp4", mode="full"),
        "3/v": capture(x_kv, fmt="nvfp4", mode="compact", global_axes=None),
        "3/expert_in": capture(x_act, fmt="mxfp4", mode="compact"),
        "3/expert_mid": capture(x_act, mask[..., 0], fmt="mxfp4", mode="full"),
        "4/expert_in": capture(x_act, fmt="mxfp8", mode="full"),
    }


def file_store(root: pathlib.Path, **kw) -> GuidanceStore:
    return GuidanceStore(GuidanceStoreConfig(kvstore=str(root), poll_s=0.005, **kw))


# ---- round trip ---------------------------------------------------------------------------------


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


@pytest.mark.parametrize("durable", [False, True])
def test_file_layout_uses_sharding_with_crc32c(tmp_path, rollout_guidance, durable):
    with file_store(tmp_path, durable=durable) as store:
        store.write(RUN, 0, rollout_guidance, policy_version=0)
        got = store.read(RUN, 0, expected_version=0)
    assert_same_guidance(rollout_guidance, got)
    entry = tmp_path / RUN / "step_0000000000" / "mb_00000"
    assert (entry / "manifest.json").is_file()
    (data,) = entry.glob("data_*")
    meta = json.loads((data / "3%2Fk" / "scales" / "zarr.json").read_text())
    (sharding,) = meta["codecs"]
    assert sharding["name"] == "sharding_indexed"
    assert {"name": "crc32c"} in sharding["configuration"]["index_codecs"]
    assert {"name": "crc32c"} in sharding["configuration"]["codecs"]
    assert meta["data_type"] == "uint8"  # float8 scales stored as their bit patterns
    assert not (data / "3%2Fv" / "mask").exists()  # absent leaves are not stored
    assert sorted(p.name for p in (data / "3%2Fk").iterdir()) == [
        "global_scale",
        "mask",
        "payload",
        "scales",
    ]


def test_write_validates_in_the_caller():
    store = GuidanceStore.in_memory()
    g = numpy_guidance(0)
    with pytest.raises(TypeError, match="must be a Guidance"):
        store.write_async(RUN, 0, {"1/k": g["20/k"].payload}, policy_version=0)
    k = g["20/k"]
    bad = Guidance(k.payload.view(np.int8), k.scales, k.global_scale, k.mask, k.fmt, k.mode)
    with pytest.raises(ValueError, match=r"guidance\['1/k'\].*uint8"):
        store.write_async(RUN, 0, {"1/k": bad}, policy_version=0)
    with pytest.raises(ValueError, match="run must be"):
        store.write_async("a/b", 0, g, policy_version=0)
    with pytest.raises(ValueError, match="policy_version"):
        store.write_async(RUN, 0, g, policy_version=-1)
    store.close()


# ---- asynchronous writes ------------------------------------------------------------------------


def test_write_async_returns_before_the_data_is_durable(monkeypatch):
    gate = threading.Event()
    fetch = store_module._fetch_to_host

    def gated_fetch(g):
        gate.wait(20)
        return fetch(g)

    monkeypatch.setattr(store_module, "_fetch_to_host", gated_fetch)
    store = GuidanceStore.in_memory(max_pending_writes=1)
    g = numpy_guidance(1)

    t0 = time.perf_counter()
    first = store.write_async(RUN, 0, g, policy_version=0)
    assert time.perf_counter() - t0 < 1.0
    assert not first.done() and not store.exists(RUN, 0)
    with pytest.raises(GuidanceMissingError):
        store.read(RUN, 0, expected_version=0)

    # Backpressure: a second write waits for a free slot (max_pending_writes=1).
    second = []
    t = threading.Thread(
        target=lambda: second.append(store.write_async(RUN, 1, g, policy_version=0))
    )
    t.start()
    t.join(0.2)
    assert t.is_alive() and not second

    gate.set()
    t.join(20)
    store.flush()
    assert first.done() and second[0].done()
    assert_same_guidance(g, store.read(RUN, 0, expected_version=0))
    assert_same_guidance(g, store.read(RUN, 1, expected_version=0))
    store.close()


def test_concurrent_writers(tmp_path):
    """Several writers (own store objects, threads) write different micro-batches of one dir."""
    data = {(s, m): numpy_guidance(10 * s + m) for s in range(2) for m in range(4)}

    def writer(m):
        with file_store(tmp_path) as store:
            futures = [
                store.write_async(RUN, s, data[s, m], policy_version=s, micro_batch=m)
                for s in range(2)
            ]
            for f in futures:
                f.result()

    threads = [threading.Thread(target=writer, args=(m,)) for m in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    with file_store(tmp_path) as store:
        assert store.entries(RUN) == sorted(data)
        for (s, m), g in data.items():
            assert_same_guidance(g, store.read(RUN, s, micro_batch=m, expected_version=s))


def test_one_entry_two_writers_exactly_one_commits(tmp_path):
    a, b = numpy_guidance(1), numpy_guidance(2)
    stores = [file_store(tmp_path), file_store(tmp_path)]
    futures = [
        st.write_async(RUN, 5, g, policy_version=1) for st, g in zip(stores, (a, b), strict=True)
    ]
    outcomes = [f.exception(timeout=30) for f in futures]
    assert sum(e is None for e in outcomes) == 1
    assert sum(isinstance(e, GuidanceExistsError) for e in outcomes) == 1
    winner = (a, b)[outcomes.index(None)]
    assert_same_guidance(winner, stores[0].read(RUN, 5, expected_version=1))
    # The loser removed its data; the failure also surfaces from flush().
    entry = tmp_path / RUN / "step_0000000005" / "mb_00000"
    assert len(list(entry.glob("data_*"))) == 1
    loser = stores[outcomes.index(None) ^ 1]
    with pytest.raises(GuidanceError, match=r"already committed|another writer") as info:
        loser.flush()
    assert isinstance(info.value.__cause__, GuidanceExistsError)
    for st in stores:
        st.close()


# ---- integrity, missing, versions ---------------------------------------------------------------


def _shard(root: pathlib.Path, step: int, site: str, leaf: str) -> pathlib.Path:
    """The one shard file of a leaf array of entry (RUN, step, 0)."""
    (data,) = (root / RUN / f"step_{step:010d}" / "mb_00000").glob("data_*")
    chunks = data / site.replace("/", "%2F") / leaf / "c"
    (path,) = [p for p in chunks.rglob("*") if p.is_file()]
    return path


def test_corruption_is_detected_not_used(tmp_path):
    with file_store(tmp_path) as store:
        for step in range(4):
            store.write(RUN, step, numpy_guidance(step), policy_version=0)

        # 1. A flipped byte inside an inner chunk: the chunk's crc32c fails.
        shard = _shard(tmp_path, 0, "20/k", "payload")
        raw = bytearray(shard.read_bytes())
        raw[3] ^= 0x5A
        shard.write_bytes(bytes(raw))
        with pytest.raises(GuidanceCorruptError, match=r"step=0.*20%2Fk/payload.*DATA_LOSS"):
            store.read(RUN, 0, expected_version=0)

        # 2. A flipped byte in the shard index (at the end of the shard file).
        shard = _shard(tmp_path, 1, "20/expert_in", "scales")
        raw = bytearray(shard.read_bytes())
        raw[-6] ^= 0x01
        shard.write_bytes(bytes(raw))
        with pytest.raises(GuidanceCorruptError, match="step=1"):
            store.read(RUN, 1, expected_version=0)

        # 3. A valid shard swapped in from another entry: caught end to end by the leaf crc32.
        _shard(tmp_path, 2, "20/k", "payload").write_bytes(
            _shard(tmp_path, 3, "20/k", "payload").read_bytes()
        )
        with pytest.raises(GuidanceCorruptError, match="crc32"):
            store.read(RUN, 2, expected_version=0)

        # 4. A deleted shard (zarr would otherwise read the fill value).
        _shard(tmp_path, 3, "20/k", "mask").unlink()
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


def test_policy_versions():
    store = GuidanceStore.in_memory()
    store.write(RUN, 0, numpy_guidance(0), policy_version=5)
    store.read(RUN, 0, expected_version=5)
    store.read(RUN, 0, expected_version=7, max_staleness=2)
    with pytest.raises(GuidanceVersionError, match=r"policy version 5.*expects 6 "):
        store.read(RUN, 0, expected_version=6)
    with pytest.raises(GuidanceVersionError, match=r"expects 8..10"):
        store.read(RUN, 0, expected_version=10, max_staleness=2)
    with pytest.raises(GuidanceVersionError):  # sampled with a newer policy than the trainer's
        store.read(RUN, 0, expected_version=4, max_staleness=3)
    assert store.read(RUN, 0, expected_version=6, fallback="rtn") is None
    assert store.fallbacks == {"version": 1}

    assert store.published_version(RUN) is None
    store.publish_version(RUN, 0)
    store.publish_version(RUN, 2)
    assert store.published_version(RUN) == 2
    with pytest.raises(ValueError, match="cannot publish older"):
        store.publish_version(RUN, 1)
    assert store.wait_for_version(RUN, 2, timeout_s=0) == 2
    with pytest.raises(TimeoutError, match="policy version 3 not published"):
        store.wait_for_version(RUN, 3, timeout_s=0.05)
    store.close()


def test_gc_and_discard_remove_their_steps_only(tmp_path):
    with file_store(tmp_path) as store:
        store.publish_version(RUN, 1)
        for step in range(4):
            for mb in range(2):
                store.write(RUN, step, numpy_guidance(step), policy_version=1, micro_batch=mb)
        store.write("other-run", 0, numpy_guidance(9), policy_version=0)

        assert store.gc(RUN, 1) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert store.entries(RUN) == [(2, 0), (2, 1), (3, 0), (3, 1)]
        with pytest.raises(GuidanceMissingError):
            store.read(RUN, 1, micro_batch=1, expected_version=1)
        assert_same_guidance(numpy_guidance(3), store.read(RUN, 3, expected_version=1))
        assert store.entries("other-run") == [(0, 0)]
        assert store.published_version(RUN) == 1
        assert sorted(p.name for p in (tmp_path / RUN).iterdir()) == [
            "policy_version.json",
            "step_0000000002",
            "step_0000000003",
        ]
        assert store.gc(RUN, 1) == []
        # A resumed run redoes steps >= 3: their entries go, uncommitted data too; earlier
        # steps, other runs and the published version stay.
        (tmp_path / RUN / "step_0000000005" / "mb_00000" / "data_x").mkdir(parents=True)
        (tmp_path / RUN / "step_0000000005" / "mb_00000" / "data_x" / "junk").write_bytes(b"x")
        assert store.discard_from(RUN, 3) == [(3, 0), (3, 1)]
        assert store.entries(RUN) == [(2, 0), (2, 1)]
        assert store.entries("other-run") == [(0, 0)]
        assert store.published_version(RUN) == 1
        assert sorted(p.name for p in (tmp_path / RUN).iterdir()) == [
            "policy_version.json",
            "step_0000000002",
        ]
        assert store.discard_from(RUN, 3) == []


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


# ---- disaggregated rollout and trainer processes ------------------------------------------------


def rollout_process(root: str, micro_batch: int, n_steps: int, staleness: int, log: str) -> None:
    """Samples each step with the newest published policy (at most `staleness` behind)."""
    written = []
    with file_store(pathlib.Path(root)) as store:
        for step in range(n_steps):
            version = store.wait_for_version(RUN, max(0, step - staleness), timeout_s=60)
            g = numpy_guidance(1000 * step + micro_batch)
            store.write_async(RUN, step, g, policy_version=version, micro_batch=micro_batch)
            written.append({"step": step, "mb": micro_batch, "version": version, "crc": digest(g)})
    pathlib.Path(log).write_text(json.dumps(written))


def trainer_process(root: str, n_steps: int, n_mb: int, staleness: int, log: str) -> None:
    """Reads each step's micro-batches before the step, publishes the new version, collects."""
    read = []
    with file_store(pathlib.Path(root)) as store:
        version = 0
        store.publish_version(RUN, version)
        for step in range(n_steps):
            for mb in range(n_mb):
                g = store.read(
                    RUN,
                    step,
                    micro_batch=mb,
                    expected_version=version,
                    max_staleness=staleness,
                    timeout_s=60,
                )
                sampled = store.read_manifest(RUN, step, mb)["policy_version"]
                read.append({"step": step, "mb": mb, "version": sampled, "crc": digest(g)})
            version += 1  # the optimizer step
            store.publish_version(RUN, version)
            store.gc(RUN, step)
        read.append({"fallbacks": store.fallback_count, "left": store.entries(RUN)})
    pathlib.Path(log).write_text(json.dumps(read))


def _spawn(fn: str, *args) -> subprocess.Popen:
    code = (
        f"import sys, json; from tests.guidance.test_store import {fn}; "
        f"{fn}(*json.loads(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_disaggregated_rollout_and_trainer_processes(tmp_path):
    n_steps, n_mb, staleness = 5, 2, 1
    root = str(tmp_path / "store")
    logs = {name: str(tmp_path / f"{name}.json") for name in ("trainer", "rollout0", "rollout1")}
    procs = [_spawn("trainer_process", root, n_steps, n_mb, staleness, logs["trainer"])]
    procs += [
        _spawn("rollout_process", root, mb, n_steps, staleness, logs[f"rollout{mb}"])
        for mb in range(n_mb)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out

    written = [
        r for mb in range(n_mb) for r in json.loads(pathlib.Path(logs[f"rollout{mb}"]).read_text())
    ]
    read = json.loads(pathlib.Path(logs["trainer"]).read_text())
    summary = read.pop()
    key = lambda r: (r["step"], r["mb"])
    assert len(written) == n_steps * n_mb
    assert [key(r) for r in read] == sorted(key(r) for r in written)  # each once, in step order
    assert sorted(read, key=key) == sorted(written, key=key)  # same data, same versions
    for r in read:
        assert r["step"] - staleness <= r["version"] <= r["step"]
    assert summary == {"fallbacks": 0, "left": []}
