"""Checkpoint directories through `safetensors`: writing shards, lazy slice reads, bad files."""

import json

import ml_dtypes
import numpy as np
import pytest

from trace_jax.models.hf_files import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    SafetensorsCheckpoint,
    load_hf_tensors,
    write_hf_checkpoint,
)


def some_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "f32": rng.normal(size=(6, 5)).astype(np.float32),
        "f16": rng.normal(size=(7,)).astype(np.float16),
        "bf16": rng.normal(size=(4, 3, 8)).astype(ml_dtypes.bfloat16),
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "big_endian": np.arange(4, dtype=">f4"),
    }


@pytest.mark.parametrize("n_shards", [1, 2])
def test_shards_round_trip_and_slices_read_alike(tmp_path, n_shards):
    tensors = some_tensors()
    keys = sorted(tensors)
    shards = ({k: tensors[k] for k in keys[s::n_shards]} for s in range(n_shards))
    write_hf_checkpoint(tmp_path, {"model_type": "x"}, shards, n_shards=n_shards)
    assert json.loads((tmp_path / CONFIG_FILE).read_text()) == {"model_type": "x"}
    assert (tmp_path / INDEX_FILE).exists() == (n_shards > 1)
    assert (tmp_path / SINGLE_FILE).exists() == (n_shards == 1)
    if n_shards > 1:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert sorted(index["weight_map"]) == keys
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert sorted(checkpoint.keys()) == keys
    assert checkpoint.dtype("bf16") == "BF16" and checkpoint.shape("bf16") == (4, 3, 8)
    loaded = load_hf_tensors(tmp_path)
    for key, want in tensors.items():
        assert loaded[key].dtype == want.dtype.newbyteorder("<"), key
        np.testing.assert_array_equal(loaded[key], want)
    block = checkpoint.read("bf16", (slice(1, 3), slice(0, 3), slice(2, 6)))
    assert block.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(block, tensors["bf16"][1:3, :, 2:6])
    np.testing.assert_array_equal(checkpoint.read("f32", (slice(4, 6),)), tensors["f32"][4:])


def test_shard_count_must_match(tmp_path):
    two = [{"a": np.zeros(2, np.float32)}, {"b": np.zeros(2, np.float32)}]
    with pytest.raises(ValueError, match="more than n_shards=1"):
        write_hf_checkpoint(tmp_path, {}, iter(two), n_shards=1)
    with pytest.raises(ValueError, match="yielded 2 shards, n_shards=3"):
        write_hf_checkpoint(tmp_path, {}, iter(two), n_shards=3)
    with pytest.raises(ValueError, match="n_shards must be >= 1"):
        write_hf_checkpoint(tmp_path, {}, iter(two), n_shards=0)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=INDEX_FILE):
        SafetensorsCheckpoint(tmp_path)
    write_hf_checkpoint(tmp_path, {}, [{"x": np.ones((4, 4), np.float32)}])
    path = tmp_path / SINGLE_FILE
    good = path.read_bytes()
    path.write_bytes(good[:-8])  # truncated data
    with pytest.raises(CheckpointError, match=f"{SINGLE_FILE}: not a readable safetensors"):
        SafetensorsCheckpoint(tmp_path)
    path.write_bytes((10**9).to_bytes(8, "little") + b"{}")  # header length beyond the file
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        SafetensorsCheckpoint(tmp_path)
    path.write_bytes(good)
    (tmp_path / INDEX_FILE).write_text(
        json.dumps({"weight_map": {"x": SINGLE_FILE, "y": SINGLE_FILE}})
    )
    with pytest.raises(CheckpointError, match=r"lacks \['y'\]"):
        SafetensorsCheckpoint(tmp_path)
