"""Hugging Face checkpoint directories on disk, read and written with `safetensors`.

Layout: `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {key: file}}`). Tensors are
numpy arrays (the `safetensors` numpy API; bfloat16 through ml_dtypes). `SafetensorsCheckpoint`
reads one slice of one tensor at a time, for loaders that place each device's block on its own
(`trace_jax.models.hf_checkpoint`); `write_hf_checkpoint` writes shards one at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model; the message lists every
    problem found."""


@contextlib.contextmanager
def _opened(path: Path):
    try:
        handle = safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    with handle as f:
        yield f


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory (`model.safetensors`, or the shards its index
    names), read lazily: `read(key, index)` reads one slice of one tensor from its file.

    Each read opens its file anew: safetensors memory-maps an open file, and every page a read
    touches stays in the process's resident memory until the file closes, so a loader that kept
    the files open would hold the whole checkpoint in host memory by its end. An open costs
    parsing the file's JSON header: about a millisecond for a file of 1280 tensors (a 30B
    model's shard holds about 1000).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            by_file: dict[str, list[str]] = {}
            for key, file in weight_map.items():
                by_file.setdefault(file, []).append(key)
        elif (self.directory / SINGLE_FILE).exists():
            by_file = {SINGLE_FILE: []}  # every tensor of the file
        else:
            raise FileNotFoundError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._entries: dict[str, tuple[Path, tuple[int, ...], str]] = {}
        for file, keys in sorted(by_file.items()):
            path = self.directory / file
            with _opened(path) as f:
                present = set(f.keys())
                absent = sorted(set(keys) - present)
                if absent:
                    raise CheckpointError(f"{path} lacks {absent}, which {INDEX_FILE} puts there")
                for key in keys or sorted(present):
                    view = f.get_slice(key)
                    self._entries[key] = (path, tuple(view.get_shape()), view.get_dtype())

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> str:
        """The safetensors dtype name ("BF16", "F32", ...)."""
        return self._entries[key][2]

    def read(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
        """Tensor `key`'s slice `index` (one step-1 slice per axis) as a new numpy array."""
        path = self._entries[key][0]
        with _opened(path) as f:
            return f.get_slice(key)[index] if index else f.get_tensor(key)


def load_hf_tensors(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory, read whole into host memory."""
    checkpoint = SafetensorsCheckpoint(directory)
    return {key: checkpoint.read(key, ()) for key in checkpoint.keys()}


def write_hf_checkpoint(
    directory: str | os.PathLike,
    hf_config: Mapping[str, Any],
    shards: Iterable[Mapping[str, np.ndarray]],
    *,
    n_shards: int = 1,
) -> None:
    """Write `config.json` and `n_shards` files of tensors, each shard a dict of HF key -> array
    taken from `shards` one at a time (a generator keeps one shard in memory): one shard is
    `model.safetensors`, more are `model-0000k-of-0000n.safetensors` plus the index."""
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(dict(hf_config), indent=2))
    weight_map, total, written = {}, 0, 0
    for k, part in enumerate(shards):
        if k >= n_shards:
            raise ValueError(f"shards yields more than n_shards={n_shards} shards")
        file = SINGLE_FILE if n_shards == 1 else f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {key: np.ascontiguousarray(v) for key, v in part.items()}
        # transformers refuses safetensors files without a "format" entry in their metadata.
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        total += sum(int(v.nbytes) for v in part.values())
        written += 1
    if written != n_shards:
        raise ValueError(f"shards yielded {written} shards, n_shards={n_shards}")
    if n_shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
