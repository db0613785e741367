"""Writes and reads of global arrays by every process of a run: two processes of two CPU devices
each, joined by `jax.distributed` (gloo) into one 4-device mesh, write one entry of guidance split
by rows over the mesh, each process its own shards, into a local directory and into a local S3
server; each then reads its own rows back into a global array. The rows each process holds, and
the entry read whole, equal the guidance written by one process bit for bit; the part records
show who wrote which shard (a shard replicated over both processes: process 0 alone); a second
write of the committed entry fails on both processes."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tests.guidance.support import RUN, assert_same_guidance, digest, file_store, numpy_guidance
from trace_jax import fp4
from trace_jax.fp4 import Guidance, GuidanceMode
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig, layout, shards
from trace_jax.guidance.layout import LEAVES

REPO = pathlib.Path(__file__).resolve().parents[2]
ROWS = 8  # 2 per device of the 4-device mesh


def global_guidance() -> dict[str, Guidance]:
    """The entry's guidance, as host arrays `[ROWS, ...]`: MXFP4 compact, NVFP4 full (mask and
    per-row global scales), and NVFP4 compact with one per-tensor global scale `[1, 1]`."""
    g = numpy_guidance(11, rows=ROWS)
    rng = np.random.default_rng(12)
    g["21/v"] = Guidance(
        rng.integers(0, 256, (ROWS, 8), dtype=np.uint8),
        rng.integers(40, 80, (ROWS, 4), dtype=np.uint8).view(np.dtype(fp4.NVFP4.scale_dtype)),
        np.full((1, 1), 0.75, np.float32),
        None,
        fp4.NVFP4,
        GuidanceMode.COMPACT,
    )
    return g


def _bytes(x) -> list[int]:
    x = np.ascontiguousarray(np.asarray(x))
    return x.reshape(-1).view(np.uint8).tolist()


def store_process(rank: int, coordinator: str, stores: dict, out: str) -> None:
    """One process of the run: writes the entry to each store with the others, reads its rows."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=rank)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    sharding = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))
    host = global_guidance()

    def place(a):
        where = shards.leaf_sharding(sharding, a.shape)
        return jax.make_array_from_callback(a.shape, where, lambda index: a[index])

    guidance = {site: jax.tree.map(place, g) for site, g in host.items()}
    report = {}
    for name, config in stores.items():
        with GuidanceStore(GuidanceStoreConfig(**config)) as store:
            written = store.write(RUN, 0, guidance, policy_version=0)
            rows = store.read(RUN, 0, expected_version=0, sharding=sharding)
            held = {
                f"{site}/{leaf}": [
                    [shards.span(shard.index, x.shape), _bytes(shard.data)]
                    for shard in x.addressable_shards
                ]
                for site, g in rows.items()
                for leaf in LEAVES
                if (x := getattr(g, leaf)) is not None
            }
            try:
                store.write(RUN, 0, guidance, policy_version=0)
                again = "no error"
            except Exception as e:
                again = type(e).__name__
            whole = digest(store.read(RUN, 0, expected_version=0))
            report[name] = {"nbytes": written.nbytes, "held": held, "again": again, "whole": whole}
    pathlib.Path(out).write_text(json.dumps(report))
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_process_writes_and_reads_its_own_rows(tmp_path, s3_server):
    stores = {
        # Tiny inner chunks: each stored shard holds several, which must tile it exactly.
        "file": {"kvstore": str(tmp_path / "store"), "inner_chunk_bytes": 8},
        "s3": {
            "kvstore": f"s3://{s3_server.bucket}/multiprocess/",
            "s3": {"endpoint": s3_server.endpoint, "credentials": "environment"},
        },
    }
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {
        **os.environ,
        **s3_server.env,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONPATH": str(REPO),
    }
    code = (
        "import sys, json; from tests.guidance.test_store_multiprocess import store_process; "
        "store_process(*json.loads(sys.argv[1]))"
    )
    outs = [str(tmp_path / f"process{rank}.json") for rank in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, json.dumps([rank, coordinator, stores, outs[rank]])],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for p in procs:
        log, _ = p.communicate(timeout=180)
        assert p.returncode == 0, log
    reports = [json.loads(pathlib.Path(out).read_text()) for out in outs]

    # The single-process write of the same arrays, read back whole.
    host = global_guidance()
    with file_store(tmp_path / "one_process") as store:
        one = store.write(RUN, 0, host, policy_version=0)
        reference = store.read(RUN, 0, expected_version=0)
    assert_same_guidance(host, reference)
    with GuidanceStore(GuidanceStoreConfig(**stores["file"])) as store:
        assert_same_guidance(reference, store.read(RUN, 0, expected_version=0))

    leaves = {
        f"{site}/{leaf}": x
        for site, g in reference.items()
        for leaf in LEAVES
        if (x := getattr(g, leaf)) is not None
    }
    for name in stores:
        for rank, report in enumerate(reports):
            got = report[name]
            assert (got["nbytes"], got["whole"]) == (one.nbytes, digest(reference))
            # Process 0 commits; a second write finds the entry committed, on both processes.
            assert got["again"] == ("GuidanceExistsError" if rank == 0 else "GuidanceError")
            assert sorted(got["held"]) == sorted(leaves)
            for leaf, held in got["held"].items():
                x = leaves[leaf]
                rows = sorted({tuple(index[0]) for index, _ in held})
                # Rows split over the mesh: this process's 4 of 8 (2 devices x 2 rows), except
                # a per-tensor global scale, which every device holds whole.
                mine = [(4 * rank, 4 * rank + 2), (4 * rank + 2, 4 * rank + 4)]
                assert rows == ([(0, 1)] if x.shape[0] == 1 else mine)
                for index, data in held:
                    want = x[tuple(slice(a, b) for a, b in index)]
                    assert data == _bytes(want), (name, rank, leaf, index)

    # Who wrote which stored shard: each process its own rows; the replicated scale, process 0.
    entry = tmp_path / "store" / RUN / "step_0000000000" / "mb_00000"
    (data,) = entry.glob("data_*")
    parts = [json.loads((data / "parts" / f"{r:05d}.json").read_text())["crc32"] for r in range(2)]
    assert sorted(parts[0]["20/k"]["payload"]) == ["0", "1"]
    assert sorted(parts[1]["20/k"]["payload"]) == ["2", "3"]
    assert list(parts[0]["21/v"]["global_scale"]) == ["0"]
    assert parts[1]["21/v"]["global_scale"] == {}
    # One object per shard, beside the array's zarr.json ("." separated keys: no directories).
    stored = sorted(p.name for p in (data / "20%2Fk" / "payload").iterdir())
    assert stored == ["c.0.0", "c.1.0", "c.2.0", "c.3.0", "zarr.json"]


@pytest.fixture(scope="module")
def mesh_2x2() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def test_owned_shards_are_each_distinct_shard_once_from_its_lowest_device(mesh_2x2):
    """Rows split over "data", replicated over "model": each row block is owned by the lower
    of the two devices that hold it."""
    rows = NamedSharding(mesh_2x2, PartitionSpec("data"))
    x = jax.device_put(np.arange(32, dtype=np.uint8).reshape(8, 4), rows)
    owned = shards.owned_shards(x)
    assert [flat for flat, _ in owned] == [0, 1]
    devices = mesh_2x2.devices
    assert [d.devices() for _, d in owned] == [{devices[0, 0]}, {devices[1, 0]}]
    np.testing.assert_array_equal(np.asarray(owned[1][1]), np.arange(16, 32).reshape(4, 4))
    assert shards.stored_shard_shape(x) == (4, 4)


def test_leaf_sharding_keeps_uneven_axes_whole(mesh_2x2):
    rows = NamedSharding(mesh_2x2, PartitionSpec("data", "model"))
    assert shards.leaf_sharding(rows, (8, 6, 3)).spec == PartitionSpec("data", "model", None)
    assert shards.leaf_sharding(rows, (8,)).spec == PartitionSpec("data")
    assert shards.leaf_sharding(rows, (1, 1)).spec == PartitionSpec(None, None)
    assert shards.leaf_sharding(rows, (8, 3)).spec == PartitionSpec("data", None)


def test_inner_chunks_tile_a_given_shard():
    """A stored shard of a global array has the jax shard's shape, which the inner chunks
    (about `inner_chunk_bytes` each) must tile exactly."""
    assert layout.inner_chunk_shape((6, 10), 1, 25, divides=True) == [2, 10]
    assert layout.inner_chunk_shape((7, 10), 1, 25, divides=True) == [1, 10]
    assert layout.inner_chunk_shape((7, 10), 1, 25) == [2, 10]  # a whole-array shard rounds up
    md = layout.array_metadata(
        (8, 32), "uint8", inner_chunk_bytes=8, zstd_level=None, shard_shape=(2, 32)
    )
    assert md["chunk_grid"]["configuration"]["chunk_shape"] == [2, 32]
    assert md["codecs"][0]["configuration"]["chunk_shape"] == [1, 8]
