"""Hugging Face Qwen3-MoE checkpoints: a numpy safetensors reader/writer and the key mapping.

Layout read and written: a directory with `config.json` and either `model.safetensors` or shards
listed in `model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {key: file}}`).

safetensors format: 8-byte little-endian u64 N, then N bytes of JSON header
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the
raw little-endian row-major data; offsets are relative to the end of the header.

Key mapping: `_RULES` maps each Hugging Face key template to a model path and a layout transform
(HF linear weights are [out, in]; the model stores einsum layouts, see `Attention` and `MoE`).
Per-expert keys `mlp.experts.{j}.*` fill slice j of the stacked [E, ...] expert tensors. Loading
checks every shape and collects all missing, unexpected and mismatched tensors into one
`CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from trace_jax.models.config import ModelConfig
from trace_jax.models.qwen3_moe import Qwen3MoE, abstract_model

# ----------------------------------------------------------------------------- safetensors

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_DTYPE_NAMES = {dt: name for name, dt in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message lists every problem found."""


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """(header dict, byte offset where the data section starts) of a safetensors file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file")
        n = int.from_bytes(raw, "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} B)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    return header, 8 + n


def read_safetensors(
    path: str | os.PathLike, *, keys: list[str] | None = None
) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file as read-only numpy arrays (memory-mapped, not copied).

    keys: read only these (KeyError naming the missing ones otherwise).
    """
    path = Path(path)
    header, start = read_safetensors_header(path)
    header.pop("__metadata__", None)
    size = path.stat().st_size
    names = list(header) if keys is None else list(keys)
    absent = [k for k in names if k not in header]
    if absent:
        raise KeyError(f"{path}: no tensors named {absent}")
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > 0 else None
    out = {}
    for name in names:
        info = header[name]
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except KeyError as e:
            raise CheckpointError(f"{path}: tensor {name!r} has a bad entry {info!r} ({e})") from e
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} {info['dtype']}{list(shape)} needs {nbytes} bytes, "
                f"offsets [{begin}, {end}) (file data section is {size - start} bytes)"
            )
        buf = mm[start + begin : start + end]
        out[name] = np.frombuffer(buf, dtype=dtype).reshape(shape)
    return out


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` (F64/F32/F16/BF16/int/bool numpy arrays) as one safetensors file."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        if dt not in _DTYPE_NAMES:
            raise ValueError(
                f"tensor {name!r} has dtype {arr.dtype}, safetensors writer supports "
                f"{sorted(str(d) for d in _DTYPE_NAMES)}"
            )
        arr = np.ascontiguousarray(arr, dtype=dt)
        header[name] = {
            "dtype": _DTYPE_NAMES[dt],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


# ------------------------------------------------------------------------------ key mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Layout:
    """How an HF tensor becomes a model tensor (per expert slice for expert rules)."""

    name: str

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        match self.name:
            case "copy":
                return shape
            case "transpose":  # HF [out, in] <-> model [in, out]
                return shape[::-1]
            case "row":  # HF [1, D] <-> model [D]
                return (1, *shape)
            case "heads_in":  # HF [H*Dh, D] <-> model [D, H, Dh]
                return (shape[1] * shape[2], shape[0])
            case "heads_out":  # HF [D, H*Dh] <-> model [H, Dh, D]
                return (shape[2], shape[0] * shape[1])
        raise AssertionError(self.name)

    def to_model(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        match self.name:
            case "copy":
                return x
            case "transpose":
                return x.T
            case "row":
                return x.reshape(shape)
            case "heads_in":
                d, h, c = shape
                return x.reshape(h, c, d).transpose(2, 0, 1)
            case "heads_out":
                h, c, d = shape
                return x.reshape(d, h, c).transpose(1, 2, 0)
        raise AssertionError(self.name)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        match self.name:
            case "copy":
                return x
            case "transpose":
                return x.T
            case "row":
                return x.reshape(1, -1)
            case "heads_in":
                d, h, c = x.shape
                return x.transpose(1, 2, 0).reshape(h * c, d)
            case "heads_out":
                h, c, d = x.shape
                return x.transpose(2, 0, 1).reshape(d, h * c)
        raise AssertionError(self.name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Rule:
    """HF key template ({i} layer, {j} expert) -> model path template, with a layout."""

    hf: str
    model: str
    layout: _Layout

    @property
    def regex(self) -> re.Pattern:
        pattern = (
            re.escape(self.hf).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)")
        )
        return re.compile(pattern + r"\Z")

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf


_COPY, _T, _ROW = _Layout(name="copy"), _Layout(name="transpose"), _Layout(name="row")
_HEADS_IN, _HEADS_OUT = _Layout(name="heads_in"), _Layout(name="heads_out")
_L = "model.layers.{i}."

_RULES: tuple[_Rule, ...] = (
    _Rule(hf="model.embed_tokens.weight", model="embed", layout=_COPY),
    _Rule(hf=_L + "self_attn.q_proj.weight", model="layers.{i}.attn.w_q", layout=_HEADS_IN),
    _Rule(hf=_L + "self_attn.k_proj.weight", model="layers.{i}.attn.w_k", layout=_HEADS_IN),
    _Rule(hf=_L + "self_attn.v_proj.weight", model="layers.{i}.attn.w_v", layout=_HEADS_IN),
    _Rule(hf=_L + "self_attn.o_proj.weight", model="layers.{i}.attn.w_o", layout=_HEADS_OUT),
    _Rule(hf=_L + "self_attn.q_norm.weight", model="layers.{i}.attn.q_norm.scale", layout=_COPY),
    _Rule(hf=_L + "self_attn.k_norm.weight", model="layers.{i}.attn.k_norm.scale", layout=_COPY),
    _Rule(hf=_L + "input_layernorm.weight", model="layers.{i}.attn_norm.scale", layout=_COPY),
    _Rule(
        hf=_L + "post_attention_layernorm.weight", model="layers.{i}.mlp_norm.scale", layout=_COPY
    ),
    _Rule(hf=_L + "mlp.gate.weight", model="layers.{i}.moe.router", layout=_T),
    _Rule(hf=_L + "mlp.experts.{j}.gate_proj.weight", model="layers.{i}.moe.w_gate", layout=_COPY),
    _Rule(hf=_L + "mlp.experts.{j}.up_proj.weight", model="layers.{i}.moe.w_up", layout=_COPY),
    _Rule(hf=_L + "mlp.experts.{j}.down_proj.weight", model="layers.{i}.moe.w_down", layout=_COPY),
    _Rule(
        hf=_L + "mlp.shared_expert.gate_proj.weight",
        model="layers.{i}.moe.shared.w_gate",
        layout=_T,
    ),
    _Rule(
        hf=_L + "mlp.shared_expert.up_proj.weight", model="layers.{i}.moe.shared.w_up", layout=_T
    ),
    _Rule(
        hf=_L + "mlp.shared_expert.down_proj.weight",
        model="layers.{i}.moe.shared.w_down",
        layout=_T,
    ),
    _Rule(hf=_L + "mlp.shared_expert_gate.weight", model="layers.{i}.moe.shared_gate", layout=_ROW),
    _Rule(hf="model.norm.weight", model="final_norm.scale", layout=_COPY),
    _Rule(hf="lm_head.weight", model="lm_head", layout=_T),
)

# Buffers some exporters store that carry no parameters.
_IGNORED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq\Z"),)


def _path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _model_leaves(model_or_abstract: Qwen3MoE) -> dict[str, tuple[tuple, Any]]:
    """Dotted path -> (state path, variable) of every Param."""
    flat = nnx.to_flat_state(nnx.state(model_or_abstract, nnx.Param))
    return {_path_str(p): (p, v) for p, v in flat}


def _match(key: str) -> tuple[_Rule, dict[str, int]] | None:
    for rule in _RULES:
        m = rule.regex.match(key)
        if m:
            return rule, {k: int(v) for k, v in m.groupdict().items()}
    return None


def _expand(cfg: ModelConfig, rule: _Rule) -> list[dict[str, int]]:
    layers = range(cfg.n_layers) if "{i}" in rule.hf else [None]
    experts = range(cfg.n_experts) if rule.per_expert else [None]
    out = []
    for i in layers:
        for j in experts:
            out.append({k: v for k, v in (("i", i), ("j", j)) if v is not None})
    return out


def model_to_hf_tensors(model: Qwen3MoE, *, dtype=np.float32) -> dict[str, np.ndarray]:
    """The model's parameters under Hugging Face Qwen3-MoE keys and layouts, cast to `dtype`."""
    leaves = _model_leaves(model)
    out = {}
    for rule in _RULES:
        for idx in _expand(model.cfg, rule):
            target = rule.model.format(**idx)
            if target not in leaves:
                continue  # e.g. no shared expert, tied LM head
            value = np.asarray(leaves[target][1].get_value())
            if rule.per_expert:
                value = value[idx["j"]]
            out[rule.hf.format(**idx)] = np.ascontiguousarray(rule.layout.to_hf(value), dtype)
    return out


def model_from_hf_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Qwen3MoE:
    """Build `Qwen3MoE(cfg)` from HF-keyed arrays, placing each after a shape check.

    Raises CheckpointError listing every missing, unexpected and shape-mismatched tensor.
    """
    abstract = abstract_model(cfg)
    graphdef, abs_state = nnx.split(abstract)
    leaves = _model_leaves(abstract)
    pdt = np.dtype(cfg.param_dtype)
    filled: dict[str, np.ndarray] = {}
    experts_seen: dict[str, set[int]] = {}
    unexpected, mismatched = [], []
    reported: set[str] = set()  # present but mismatched: not also reported missing
    tied_head = None
    for key in sorted(tensors):
        if any(p.match(key) for p in _IGNORED):
            continue
        found = _match(key)
        if found is None:
            unexpected.append(f"{key} (no rule)")
            continue
        rule, idx = found
        if idx.get("i", 0) >= cfg.n_layers or idx.get("j", 0) >= cfg.n_experts:
            unexpected.append(f"{key} (index beyond n_layers={cfg.n_layers}/E={cfg.n_experts})")
            continue
        target = rule.model.format(**idx)
        if target not in leaves:
            if target == "lm_head" and cfg.tie_embeddings:
                tied_head = key
                continue
            unexpected.append(f"{key} (model has no {target}; check the config)")
            continue
        full_shape = tuple(leaves[target][1].shape)
        shape = full_shape[1:] if rule.per_expert else full_shape
        arr = tensors[key]
        expected = rule.layout.hf_shape(shape)
        if tuple(arr.shape) != expected:
            mismatched.append(f"{key}: got {list(arr.shape)}, expected {list(expected)}")
            reported.add(key)
            continue
        value = rule.layout.to_model(np.asarray(arr), shape).astype(pdt)
        if rule.per_expert:
            if target not in filled:
                filled[target] = np.zeros(full_shape, pdt)
            filled[target][idx["j"]] = value
            experts_seen.setdefault(target, set()).add(idx["j"])
        else:
            filled[target] = value
    if tied_head is not None and "embed" in filled:
        if not np.array_equal(np.asarray(tensors[tied_head], pdt), filled["embed"]):
            mismatched.append(f"{tied_head}: differs from the tied embedding (tie_embeddings)")

    missing = []
    for rule in _RULES:
        for idx in _expand(cfg, rule):
            target = rule.model.format(**idx)
            if target not in leaves:
                continue
            key = rule.hf.format(**idx)
            absent = target not in filled or (
                rule.per_expert and idx["j"] not in experts_seen[target]
            )
            if absent and key not in reported:
                missing.append(key)
    if missing or unexpected or mismatched:
        lines = [f"checkpoint does not fit ModelConfig({_short(cfg)}):"]
        for title, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape mismatch", mismatched),
        ):
            if items:
                lines.append(f"  {title} ({len(items)}):")
                lines += [f"    {s}" for s in items[:50]]
                if len(items) > 50:
                    lines.append(f"    ... and {len(items) - 50} more")
        raise CheckpointError("\n".join(lines))

    flat = []
    for name, (path, var) in leaves.items():
        flat.append((path, var.replace(jnp.asarray(filled[name]))))
    unfilled = set(_path_str(p) for p, _ in nnx.to_flat_state(abs_state)) - set(leaves)
    if unfilled:  # only Params exist in this model; anything else would be a bug here
        raise AssertionError(f"model has non-Param state {sorted(unfilled)}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _short(cfg: ModelConfig) -> str:
    return (
        f"L={cfg.n_layers}, D={cfg.d_model}, H={cfg.n_heads}, Hkv={cfg.n_kv_heads}, "
        f"Dh={cfg.head_dim}, E={cfg.n_experts}, K={cfg.top_k}, F={cfg.d_ff_expert}, "
        f"V={cfg.vocab_size}"
    )


# ----------------------------------------------------------------------- checkpoint directory


def load_hf_tensors(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of `model.safetensors` or of the shards named by the index (memory-mapped)."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for key, file in weight_map.items():
            by_file.setdefault(file, []).append(key)
        out = {}
        for file, keys in sorted(by_file.items()):
            out.update(read_safetensors(directory / file, keys=keys))
        return out
    single = directory / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    return read_safetensors(single)


def load_hf_checkpoint(directory: str | os.PathLike, **config_overrides) -> Qwen3MoE:
    """Load a Hugging Face Qwen3-MoE directory into `Qwen3MoE`.

    config_overrides: ModelConfig fields to set beyond config.json (e.g. dtype=jnp.float32).
    """
    directory = Path(directory)
    hf_config = json.loads((directory / CONFIG_FILE).read_text())
    cfg = ModelConfig.from_hf_config(hf_config, **config_overrides)
    return model_from_hf_tensors(cfg, load_hf_tensors(directory))


def save_hf_checkpoint(
    directory: str | os.PathLike, model: Qwen3MoE, *, n_shards: int = 1, dtype=np.float32
) -> None:
    """Write config.json and the weights (one file, or `n_shards` files plus the index)."""
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = model.cfg.to_hf_config()
    hf_config["torch_dtype"] = str(np.dtype(dtype))
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
    tensors = model_to_hf_tensors(model, dtype=dtype)
    if n_shards == 1:
        write_safetensors(directory / SINGLE_FILE, tensors)
        return
    keys = sorted(tensors)
    weight_map = {}
    for s in range(n_shards):
        file = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s::n_shards]}
        write_safetensors(directory / file, part)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(int(t.nbytes) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
