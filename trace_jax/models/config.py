"""Model configuration and the quantization-site contract shared by every model module.

`ModelConfig` describes a Qwen3-MoE-style decoder (grouped-query attention with per-head q/k RMSNorm
and RoPE, top-k softmax-routed SwiGLU experts, optional shared expert). Presets are classmethods
derived from `tiny()` with `dataclasses.replace`.

A quantization site is a callable `site(x, *, name, layer) -> x'` passed into the forward call. The
model calls it at exactly the places that TRACE quantizes (SPEC section 3) and nowhere else:

| name         | tensor                                   | shape          | contraction dim |
| ------------ | ---------------------------------------- | -------------- | --------------- |
| `expert_in`  | routed experts' input, once per token    | [B, T, D]      | D (last)        |
| `expert_mid` | down-projection input, (token, slot) order | [B, T, K, F] | F (last)        |
| `w_gate`     | routed gate projections                  | [E, F, D]      | D (last)        |
| `w_up`       | routed up projections                    | [E, F, D]      | D (last)        |
| `w_down`     | routed down projections                  | [E, D, F]      | F (last)        |
| `k`          | attention keys after k-norm and RoPE     | [B, T, Hkv, Dh] | Dh (last)      |
| `v`          | attention values                         | [B, T, Hkv, Dh] | Dh (last)      |

Each site is called once per layer and forward call; `layer` is a Python int in [0, n_layers).
"expert_mid" is also given `experts=` the int32 [B, T, K] expert id of each slot, so that a site
can align per-slot data (the rollout's guidance) with the slots of this forward.

The kernels a forward call runs are chosen by its site (`trace_jax.models.backends`).

Axis legend: B batch, T time, D model, E experts, K top-k, F expert ffn, Hkv kv heads, Dh head dim.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.models.backends import PREFILL_ATTENTION
from trace_jax.models.grouped_matmul import GroupedMatmul


class SiteName(enum.StrEnum):
    """Names of the quantization sites; members are `str`, so `name == "k"` works in a site."""

    EXPERT_IN = "expert_in"
    EXPERT_MID = "expert_mid"
    W_GATE = "w_gate"
    W_UP = "w_up"
    W_DOWN = "w_down"
    K = "k"
    V = "v"


class QuantSite(Protocol):
    """A quantization hook: returns an array of the same shape and dtype as `x`."""

    def __call__(
        self, x: jax.Array, *, name: str, layer: int, experts: jax.Array | None = None
    ) -> jax.Array: ...


def identity_site(
    x: jax.Array, *, name: str, layer: int, experts: jax.Array | None = None
) -> jax.Array:
    """The default site: no quantization."""
    del name, layer, experts
    return x


def site_records(site: QuantSite) -> dict[str, dict[str, Any]]:
    """The dicts a stateful site fills during a forward call, by name (`records()`: e.g.
    `QuantSites`' coverage, statistics and captures, keyed by site key; their values pytrees of
    arrays); {} for a site without (plain functions). A checkpointed block (`ModelConfig.remat`)
    hands the entries it writes out of its trace through these."""
    records = getattr(site, "records", None)
    return {} if records is None else records()


def take_written_records(
    records: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The entries of a site's `records` (`site_records`) written since the copy `before`
    (`{name: dict(d) for name, d in records.items()}`), removed from `records`: name -> {key:
    value}. Entries written inside a transform's trace (a checkpoint, a shard_map) hold its
    tracers, so they leave the transform as its outputs and are written back outside
    (`records[name].update(...)`)."""
    return {
        name: {k: d.pop(k) for k in list(d) if before[name].get(k) is not d[k]}
        for name, d in records.items()
    }


# Hugging Face `Qwen3MoeConfig` keys. One setting may have two names: transformers 5 writes
# `num_local_experts`, `rope_parameters: {"rope_theta", "rope_type"}` and `dtype`; older configs
# (the Hub's Qwen3-30B-A3B) `num_experts`, a top-level `rope_theta` (`rope_scaling` for RoPE
# variants) and `torch_dtype`. A config may hold both names only with one value.
_HF_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    ("num_experts", "num_local_experts"),
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_HF_SYNONYMS = (("num_experts", "num_local_experts"), ("torch_dtype", "dtype"))
# transformers' RoPE base for a config that names none (`RotaryEmbeddingConfigMixin.default_theta`).
_HF_DEFAULT_ROPE_THETA = 10_000.0


def _hf_named(hf: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The keys of `names` that `hf` sets (not None), with their values."""
    return {n: hf[n] for n in names if hf.get(n) is not None}


def _hf_rope_theta(hf: Mapping[str, Any], problems: list[str]) -> float:
    """The RoPE base `hf` names (top-level `rope_theta`, `rope_parameters` or `rope_scaling`),
    transformers' default where it names none; appends to `problems` a RoPE type other than
    default, keys default RoPE does not take and places naming different bases."""
    thetas = _hf_named(hf, ("rope_theta",))
    for name in ("rope_parameters", "rope_scaling"):
        params = hf.get(name)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            problems.append(f"{name}={params!r} (expected a dict)")
            continue
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            problems.append(f"{name} rope_type={kind!r} (only default RoPE is implemented)")
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta"})
        if extra:
            problems.append(f"{name} keys {extra} (default RoPE takes only rope_theta)")
        if params.get("rope_theta") is not None:
            thetas[f"{name}.rope_theta"] = params["rope_theta"]
    if len({float(v) for v in thetas.values()}) > 1:
        problems.append(f"different RoPE bases {thetas}")
    return float(next(iter(thetas.values()), _HF_DEFAULT_ROPE_THETA))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and numerics of a Qwen3-MoE-style decoder.

    Attributes:
      vocab_size: V, number of token ids.
      d_model: D, residual stream width.
      n_layers: L, decoder blocks (every block has attention and an MoE).
      n_heads: H, query heads. n_kv_heads: Hkv, key/value heads (H % Hkv == 0).
      head_dim: Dh, per-head width (need not equal D / H; must be even for RoPE).
      n_experts: E, routed experts per layer. top_k: K, experts per token.
      d_ff_expert: F, hidden width of each routed SwiGLU expert.
      shared_expert_d_ff: hidden width of the always-on shared expert; 0 means none.
      shared_expert_gated: scale the shared expert by `sigmoid(x @ w)` (Qwen2-MoE/Qwen3-Next).
      rope_theta: RoPE base. rms_eps: RMSNorm epsilon.
      norm_topk_prob: renormalize the K selected router probabilities to sum to one.
      router_aux_loss_coef: weight of the Switch load-balancing loss; the model reports the
        unscaled loss and the trainer multiplies by this coefficient.
      tie_embeddings: LM head shares the embedding matrix.
      init_std: standard deviation of the normal initializer of every matrix.
      dtype: compute dtype. param_dtype: storage dtype of parameters.
      grouped_matmul: the routed experts' grouped matmul, "ragged_dot" (`jax.lax.ragged_dot`),
        "tiled" (`grouped_matmul.tiled_ragged_dot`: no E-fold dense expansion where XLA has no
        grouped kernel), "pallas" (the Pallas grouped matmul forward, the tiled form's backward)
        or "auto" (`grouped_matmul.resolve`: "pallas" on a GPU or a TPU; elsewhere tiled for many
        rows per expert, ragged_dot for few); the same products up to float32 summation order.
      prefill_attention: the attention of a prefill chunk over the KV cache (several new
        tokens against the cache: `forward_cached`), "xla" (`attention.attend`: float32 scores
        of a block of queries against every slot), "pallas" (`kernels_pallas.prefill_attention`:
        flash attention, Triton or Mosaic; where Pallas does not compile and no interpretation
        is asked for, an error, as for every "pallas"), "cudnn" (cuDNN's fused attention,
        `attention.causal_prefix_attention`, for chunks of whole prompts, which start at slot 0;
        other chunks take "pallas"; an NVIDIA GPU only) or "auto" ("pallas" on a GPU or a TPU,
        "xla" elsewhere). Decode steps and the trainer's forward are not affected.
      remat: recompute each block's activations in the backward pass from the block's input
        (`nnx.remat` per block) instead of keeping them: a training step's activation memory
        falls from every block's (attention scores [B, H, T, T] among them) to about one
        block's, for about one more forward pass of compute. The values are the same.
      predecode_experts: the FP4 rollout's packed experts on the Pallas kernel
        (`kernels_pallas.fp4_moe_matmul`): whether calls with the rows per expert from which it
        pays (`predecode_pays`: prefill chunks, not decode steps) decode the weights in one pass
        before a bf16 grouped matmul (`predecode=True`, `predecoded.py`) instead of in the
        kernel. None: the op's default (`PREDECODE_BY_DEFAULT`), True: those calls do, False:
        none does. The same products up to float32 summation order.
      moe_routing_per_device: the cached forward's (rollout prefill and decode) routed experts on
        a data-parallel mesh (`moe.data_parallel_mesh`: rows split over "data", weights
        replicated) sort, multiply and combine each device's rows on that device, in a
        shard_map: no collective, the same values bit for bit. False, and always in the
        trainer's forward: GSPMD partitions the routing of all rows together (gathers and
        reductions every layer; per-device routing would change the weight gradients'
        summation order).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    d_ff_expert: int
    shared_expert_d_ff: int = 0
    shared_expert_gated: bool = True
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    grouped_matmul: str = "ragged_dot"
    prefill_attention: str = "xla"
    remat: bool = False
    predecode_experts: bool | None = None
    moe_routing_per_device: bool = True

    def __post_init__(self):
        choices = [g.value for g in GroupedMatmul]
        if self.grouped_matmul not in choices:
            raise ValueError(
                f"ModelConfig.grouped_matmul must be one of {choices}, got {self.grouped_matmul!r}"
            )
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(
                f"ModelConfig.prefill_attention must be one of {list(PREFILL_ATTENTION)}, got "
                f"{self.prefill_attention!r}"
            )
        if self.predecode_experts not in (None, True, False):
            raise ValueError(
                "ModelConfig.predecode_experts must be None, True or False, got "
                f"{self.predecode_experts!r}"
            )
        positive = (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "n_experts",
            "top_k",
            "d_ff_expert",
        )
        for field in positive:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if (
            isinstance(self.shared_expert_d_ff, bool)
            or not isinstance(self.shared_expert_d_ff, int | np.integer)
            or self.shared_expert_d_ff < 0
        ):
            raise ValueError(
                "ModelConfig.shared_expert_d_ff must be an int >= 0 (0 = no shared expert), "
                f"got {self.shared_expert_d_ff!r}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} must be divisible by "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"ModelConfig.top_k={self.top_k} must be <= n_experts={self.n_experts}"
            )
        for field in ("remat", "moe_routing_per_device"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(
                    f"ModelConfig.{field} must be a bool, got {getattr(self, field)!r}"
                )
        for field in ("rope_theta", "rms_eps", "init_std"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or not np.isfinite(value) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a finite number > 0, got {value!r}")
        coef = self.router_aux_loss_coef
        if not isinstance(coef, int | float) or not np.isfinite(coef) or coef < 0:
            raise ValueError(
                f"ModelConfig.router_aux_loss_coef must be a finite number >= 0, got {coef!r}"
            )
        for field in ("dtype", "param_dtype"):
            value = getattr(self, field)
            try:
                dt = jnp.dtype(value)
            except TypeError as e:
                raise ValueError(f"ModelConfig.{field}={value!r} is not a dtype") from e
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"ModelConfig.{field} must be a floating dtype, got {dt}")
            object.__setattr__(self, field, dt)

    # ----------------------------------------------------------------------------- presets

    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """CPU test model (~0.45M params): V=64, D=64, L=4, H=4, Hkv=2, Dh=16, E=8, K=2, F=64."""
        cfg = cls(
            vocab_size=64,
            d_model=64,
            n_layers=4,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            n_experts=8,
            top_k=2,
            d_ff_expert=64,
        )
        return dataclasses.replace(cfg, **overrides)

    @classmethod
    def small(cls, **overrides) -> ModelConfig:
        """GPU RL model (~64M params, ~20M active): V=8192, D=512, L=8, E=32, K=4, F=128."""
        cfg = dataclasses.replace(
            cls.tiny(),
            vocab_size=8192,
            d_model=512,
            n_layers=8,
            n_heads=8,
            n_kv_heads=2,
            head_dim=64,
            n_experts=32,
            top_k=4,
            d_ff_expert=128,
        )
        return dataclasses.replace(cfg, **overrides)

    @classmethod
    def qwen3_5_35b_a3b(cls, **overrides) -> ModelConfig:
        """Shape-only stand-in for the paper's Qwen3.5-35B-A3B (about 30.5B params, 3.3B active).

        These are the Qwen3-30B-A3B shapes (all layers softmax attention + MoE); the real
        Qwen3.5 model is hybrid and differs. Use with `jax.eval_shape`; never allocate on CPU.
        """
        cfg = dataclasses.replace(
            cls.tiny(),
            vocab_size=151936,
            d_model=2048,
            n_layers=48,
            n_heads=32,
            n_kv_heads=4,
            head_dim=128,
            n_experts=128,
            top_k=8,
            d_ff_expert=768,
        )
        return dataclasses.replace(cfg, **overrides)

    # ----------------------------------------------------------------------- Hugging Face

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides) -> ModelConfig:
        """Map a Hugging Face Qwen3-MoE `config.json` dict of either generation (transformers 5's
        `num_local_experts` / `rope_parameters` / `dtype`, or the older `num_experts` / top-level
        `rope_theta` / `torch_dtype`); `overrides` set dtype etc. Keys a config leaves out take
        transformers' defaults (RoPE base 10000, `norm_topk_prob` False). The checkpoint's storage
        dtype does not set `param_dtype` (float32 master weights unless overridden).

        Raises ValueError, listing every problem, on missing keys, on one setting named twice with
        different values, and on what this model does not implement: `model_type` other than
        qwen3_moe, dense `mlp_only_layers`, `decoder_sparse_step != 1`, attention bias or dropout,
        RoPE other than default, a sliding window, an activation other than silu.
        """
        missing = [
            " or ".join(k) if isinstance(k, tuple) else k
            for k in _HF_REQUIRED_KEYS
            if not _hf_named(hf, k if isinstance(k, tuple) else (k,))
        ]
        if missing:
            raise ValueError(f"Hugging Face config lacks required keys {missing}")
        problems = []
        if hf.get("model_type", "qwen3_moe") != "qwen3_moe":
            problems.append(f"model_type={hf['model_type']!r} (expected 'qwen3_moe')")
        if hf.get("mlp_only_layers"):
            problems.append(f"mlp_only_layers={hf['mlp_only_layers']!r} (dense layers)")
        if hf.get("decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step={hf['decoder_sparse_step']!r} (expected 1)")
        if hf.get("attention_bias", False):
            problems.append("attention_bias=True")
        if float(hf.get("attention_dropout") or 0.0) != 0.0:
            problems.append(f"attention_dropout={hf['attention_dropout']!r} (expected 0)")
        rope_theta = _hf_rope_theta(hf, problems)
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            problems.append(f"partial_rotary_factor={hf['partial_rotary_factor']!r}")
        if hf.get("use_sliding_window", False):
            problems.append("use_sliding_window=True")
        if hf.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={hf['hidden_act']!r} (expected 'silu')")
        for names in _HF_SYNONYMS:
            named = _hf_named(hf, names)
            values = {v.removeprefix("torch.") if isinstance(v, str) else v for v in named.values()}
            if len(values) > 1:
                problems.append(f"one setting, two values: {named}")
        if problems:
            raise ValueError(f"Hugging Face config does not fit this model: {problems}")
        n_heads = int(hf["num_attention_heads"])
        fields = dict(
            vocab_size=int(hf["vocab_size"]),
            d_model=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf["num_key_value_heads"]),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // n_heads),
            n_experts=int(next(iter(_hf_named(hf, _HF_SYNONYMS[0]).values()))),
            top_k=int(hf["num_experts_per_tok"]),
            d_ff_expert=int(hf["moe_intermediate_size"]),
            shared_expert_d_ff=int(hf.get("shared_expert_intermediate_size") or 0),
            rope_theta=rope_theta,
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face `Qwen3MoeConfig` dict of this model (inverse of `from_hf_config`).

        The keys transformers 5 writes, plus `num_experts` and a top-level `rope_theta` with the
        same values: transformers 4 reads those two instead (without them it silently takes its
        defaults, 128 experts and RoPE base 10000), transformers 5 reads them as the same
        settings. `shared_expert_intermediate_size` (this model's optional shared expert) is not
        a Qwen3-MoE key: transformers ignores it.
        """
        hf = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "intermediate_size": self.d_ff_expert * self.top_k,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.n_experts,
            "num_experts": self.n_experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.d_ff_expert,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": self.norm_topk_prob,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": False,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_position_embeddings": 40960,
            "initializer_range": self.init_std,
            "tie_word_embeddings": self.tie_embeddings,
            "use_cache": True,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
            "dtype": jnp.dtype(self.param_dtype).name,
        }
        if self.shared_expert_d_ff:
            hf["shared_expert_intermediate_size"] = self.shared_expert_d_ff
        return hf

    # ----------------------------------------------------------------------------- derived

    @property
    def q_per_kv(self) -> int:
        """G, query heads per key/value head."""
        return self.n_heads // self.n_kv_heads
