"""Hugging Face Qwen3-MoE checkpoints into and out of `Qwen3MoE`: the key mapping, lazy sharded
loading and saving (the files themselves: `trace_jax.models.hf_files`).

Loading goes straight to device arrays: each parameter is `jax.make_array_from_callback` with
its target sharding, and the callback reads from the files only the block its device holds
(`SafetensorsCheckpoint.read`), so a checkpoint loads onto a mesh without ever being whole in
host memory. Per-expert keys `mlp.experts.{j}.*` fill slice j of the stacked [E, ...] expert
tensors: a device holding experts [a, b) reads those experts' tensors only.

Key mapping: `_RULES` maps each Hugging Face key template to a model path and a layout transform
(HF linear weights are [out, in]; the model stores einsum layouts, see `Attention` and `MoE`).
Loading checks every shape from the file headers before reading any data and collects all
missing, unexpected and mismatched tensors into one `CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from trace_jax.models.config import ModelConfig
from trace_jax.models.hf_files import (
    CONFIG_FILE,
    CheckpointError,
    SafetensorsCheckpoint,
    write_hf_checkpoint,
)
from trace_jax.models.qwen3_moe import Qwen3MoE, abstract_model

# Where each parameter goes: a mapping from its dotted model path ("layers.0.moe.w_gate") to a
# sharding, or a function of (path, jax.ShapeDtypeStruct) that returns one
# (`trace_jax.rl.sharding.param_sharding_rule(mesh)` gives the RL steps' placement).
Shardings = Mapping[str, jax.sharding.Sharding] | Callable[[str, Any], jax.sharding.Sharding]


class _ArrayTensors:
    """`SafetensorsCheckpoint`'s reading interface over arrays in memory."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self._tensors = tensors

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def read(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(self._tensors[key])[index]


# ------------------------------------------------------------------------------ key mapping


def _slices(bounds) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in bounds)


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

    def read(self, source, key: str, bounds: list[tuple[int, int]], shape) -> np.ndarray:
        """The model tensor's block `bounds` ([start, stop) per axis of the model `shape`), read
        from HF tensor `key` of `source`: only that block, whole heads where a head is split."""
        match self.name:
            case "copy":
                return source.read(key, _slices(bounds))
            case "transpose":
                return source.read(key, _slices(bounds[::-1])).T
            case "row":
                ((a, b),) = bounds
                return source.read(key, (slice(0, 1), slice(a, b))).reshape(b - a)
            case "heads_in":
                (d0, d1), (h0, h1), (c0, c1) = bounds
                c = shape[2]
                x = source.read(key, (slice(h0 * c, h1 * c), slice(d0, d1)))
                return x.reshape(h1 - h0, c, d1 - d0).transpose(2, 0, 1)[:, :, c0:c1]
            case "heads_out":
                (h0, h1), (c0, c1), (d0, d1) = bounds
                c = shape[1]
                x = source.read(key, (slice(d0, d1), slice(h0 * c, h1 * c)))
                return x.reshape(d1 - d0, h1 - h0, c).transpose(1, 2, 0)[:, c0:c1, :]
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
# transformers 5's in-memory expert layout, which its save_pretrained writes only when asked to
# (`save_original_format=False`); named in the error, not read.
_FUSED_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)\Z")


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


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face key the model of `cfg` reads and writes, with its HF shape."""
    leaves = _model_leaves(abstract_model(cfg))
    out = {}
    for rule in _RULES:
        for idx in _expand(cfg, rule):
            target = rule.model.format(**idx)
            if target in leaves:  # absent: no shared expert, tied LM head
                shape = tuple(leaves[target][1].shape)
                out[rule.hf.format(**idx)] = rule.layout.hf_shape(
                    shape[1:] if rule.per_expert else shape
                )
    return out


# ------------------------------------------------------------------------------------ loading


@dataclasses.dataclass(frozen=True)
class _Placement:
    """How one model parameter is read: its rule and HF keys (key j of expert j, for experts)."""

    rule: _Rule
    keys: tuple[str, ...]


def _plan(cfg: ModelConfig, source, leaves) -> dict[str, _Placement]:
    """The HF keys of every model parameter, checked against the file headers' shapes.

    Raises CheckpointError listing every missing, unexpected and shape-mismatched tensor."""
    keys: dict[str, dict[int, str]] = {}  # model path -> {expert or 0: HF key}
    rules: dict[str, _Rule] = {}
    unexpected, mismatched = [], []
    for key in sorted(source.keys()):
        if any(p.match(key) for p in _IGNORED):
            continue
        found = _match(key)
        if found is None:
            fused = " (fused expert tensors: save with save_original_format=True)"
            unexpected.append(f"{key} (no rule){fused if _FUSED_EXPERTS.match(key) else ''}")
            continue
        rule, idx = found
        if idx.get("i", 0) >= cfg.n_layers or idx.get("j", 0) >= cfg.n_experts:
            unexpected.append(f"{key} (index beyond n_layers={cfg.n_layers}/E={cfg.n_experts})")
            continue
        target = rule.model.format(**idx)
        if target not in leaves:
            if not (target == "lm_head" and cfg.tie_embeddings):  # checked against embed later
                unexpected.append(f"{key} (model has no {target}; check the config)")
            continue
        full_shape = tuple(leaves[target][1].shape)
        expected = rule.layout.hf_shape(full_shape[1:] if rule.per_expert else full_shape)
        if tuple(source.shape(key)) != expected:
            mismatched.append(f"{key}: got {list(source.shape(key))}, expected {list(expected)}")
            keys.setdefault(target, {}).setdefault(idx.get("j", 0), "")  # not also "missing"
            continue
        keys.setdefault(target, {})[idx.get("j", 0)] = key
        rules[target] = rule

    missing = []
    for rule in _RULES:
        for idx in _expand(cfg, rule):
            target = rule.model.format(**idx)
            if target in leaves and idx.get("j", 0) not in keys.get(target, {}):
                missing.append(rule.hf.format(**idx))
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
    return {
        target: _Placement(rules[target], tuple(found[j] for j in sorted(found)))
        for target, found in keys.items()
    }


def _short(cfg: ModelConfig) -> str:
    return (
        f"L={cfg.n_layers}, D={cfg.d_model}, H={cfg.n_heads}, Hkv={cfg.n_kv_heads}, "
        f"Dh={cfg.head_dim}, E={cfg.n_experts}, K={cfg.top_k}, F={cfg.d_ff_expert}, "
        f"V={cfg.vocab_size}"
    )


def _read_block(source, placement: _Placement, shape, index, dtype) -> np.ndarray:
    """The block `index` (a tuple of slices) of the model parameter of `shape`, as `dtype`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    bounds = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {index} of a parameter of shape {shape}")
        bounds.append((start, stop))
    layout = placement.rule.layout
    if not placement.rule.per_expert:
        return np.asarray(layout.read(source, placement.keys[0], bounds, shape), dtype)
    (e0, e1), inner = bounds[0], bounds[1:]
    out = np.empty([e1 - e0, *(b - a for a, b in inner)], dtype)
    for j in range(e0, e1):
        out[j - e0] = layout.read(source, placement.keys[j], inner, shape[1:])
    return out


def _sharding(shardings: Shardings | None, path: str, leaf) -> jax.sharding.Sharding:
    if shardings is None:  # one device, as a restored checkpoint is
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if callable(shardings):
        return shardings(path, leaf)
    if path not in shardings:
        raise ValueError(f"shardings names no sharding for parameter {path!r}")
    return shardings[path]


def model_from_hf_tensors(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray] | SafetensorsCheckpoint,
    *,
    shardings: Shardings | None = None,
) -> Qwen3MoE:
    """Build `Qwen3MoE(cfg)` from HF-keyed tensors (arrays, or a checkpoint read lazily).

    Every parameter is `jax.make_array_from_callback` with its sharding (`shardings`; None: the
    first device), whose callback reads only the block its device holds, cast to
    `cfg.param_dtype`; devices holding the same block share one read. Shapes are checked first:
    raises CheckpointError listing every missing, unexpected and shape-mismatched tensor.
    """
    source = tensors if isinstance(tensors, SafetensorsCheckpoint) else _ArrayTensors(tensors)
    abstract = abstract_model(cfg)
    graphdef, abs_state = nnx.split(abstract)
    leaves = _model_leaves(abstract)
    unfilled = set(_path_str(p) for p, _ in nnx.to_flat_state(abs_state)) - set(leaves)
    if unfilled:  # only Params exist in this model; anything else would be a bug here
        raise AssertionError(f"model has non-Param state {sorted(unfilled)}")
    placements = _plan(cfg, source, leaves)
    dtype = np.dtype(cfg.param_dtype)
    if cfg.tie_embeddings and "lm_head.weight" in source.keys():
        head, embed = (source.read(k, ()) for k in ("lm_head.weight", "model.embed_tokens.weight"))
        if not np.array_equal(head.astype(dtype), embed.astype(dtype)):
            raise CheckpointError("lm_head.weight differs from the tied embedding (tie_embeddings)")

    flat = []
    for name, (path, var) in leaves.items():
        shape = tuple(var.shape)
        blocks: dict[tuple, np.ndarray] = {}  # one read per distinct block (replicas share it)

        def block(index, placement=placements[name], shape=shape, blocks=blocks):
            key = tuple(s.indices(n) for s, n in zip(index, shape, strict=False))
            if key not in blocks:
                blocks[key] = _read_block(source, placement, shape, index, dtype)
            return blocks[key]

        sharding = _sharding(shardings, name, jax.ShapeDtypeStruct(shape, dtype))
        flat.append((path, var.replace(jax.make_array_from_callback(shape, sharding, block))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def read_hf_config(directory: str | os.PathLike, **config_overrides) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory's `config.json` (`from_hf_config`)."""
    hf_config = json.loads((Path(directory) / CONFIG_FILE).read_text())
    return ModelConfig.from_hf_config(hf_config, **config_overrides)


def load_hf_checkpoint(
    directory: str | os.PathLike, *, shardings: Shardings | None = None, **config_overrides
) -> Qwen3MoE:
    """Load a Hugging Face Qwen3-MoE directory into `Qwen3MoE`, each parameter straight onto its
    devices (`shardings`, see `model_from_hf_tensors`; None: the first device), reading from
    the files only what each device holds.

    config_overrides: ModelConfig fields to set beyond config.json (e.g. dtype=jnp.float32).
    """
    cfg = read_hf_config(directory, **config_overrides)
    return model_from_hf_tensors(cfg, SafetensorsCheckpoint(directory), shardings=shardings)


# ------------------------------------------------------------------------------------- saving


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


def save_hf_checkpoint(
    directory: str | os.PathLike, model: Qwen3MoE, *, n_shards: int = 1, dtype=np.float32
) -> None:
    """Write config.json (`ModelConfig.to_hf_config`, the keys transformers 5 reads, which
    transformers 4 reads as well) and the weights as `dtype` (one file, or `n_shards` files plus
    the index)."""
    hf_config = model.cfg.to_hf_config()
    hf_config["dtype"] = np.dtype(dtype).name
    tensors = model_to_hf_tensors(model, dtype=dtype)
    keys = sorted(tensors)
    shards = ({k: tensors[k] for k in keys[s::n_shards]} for s in range(n_shards))
    write_hf_checkpoint(directory, hf_config, shards, n_shards=n_shards)
