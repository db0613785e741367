"""GuidanceWriter: validation in the caller, the zarr3 layout it writes, asynchronous writes with
backpressure, concurrent writers of different entries, and one commit per entry."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from tests.guidance.support import (
    RUN,
    assert_same_guidance,
    file_store,
    numpy_guidance,
)
from trace_jax.fp4 import Guidance
from trace_jax.guidance import (
    GuidanceError,
    GuidanceExistsError,
    GuidanceMissingError,
    GuidanceReader,
    GuidanceStore,
    GuidanceStoreConfig,
    GuidanceWriter,
)
from trace_jax.guidance import writer as writer_module
from trace_jax.guidance.kvstore import Kv


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
    with pytest.raises(GuidanceError, match="closed"):
        store.write_async(RUN, 0, g, policy_version=0)


def test_write_async_returns_before_the_data_is_durable(monkeypatch):
    gate = threading.Event()
    fetch = writer_module.fetch_to_host

    def gated_fetch(g):
        gate.wait(20)
        return fetch(g)

    monkeypatch.setattr(writer_module, "fetch_to_host", gated_fetch)
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


def test_writer_and_reader_work_alone(tmp_path):
    """A process that only writes (the rollout) and one that only reads (the trainer) each open
    their own part over the same directory."""
    config = GuidanceStoreConfig(kvstore=str(tmp_path))
    writer = GuidanceWriter(Kv.open(config), config)
    result = writer.write(RUN, 2, numpy_guidance(5), policy_version=4, micro_batch=1)
    assert (result.key.step, result.key.micro_batch, result.policy_version) == (2, 1, 4)
    writer.close()
    reader = GuidanceReader(Kv.open(config), config)
    got = reader.read(RUN, 2, micro_batch=1, expected_version=4)
    assert_same_guidance(numpy_guidance(5), got)
    reader.close()
