"""Qwen3-MoE-style decoder (Flax NNX) with FP4 quantization sites, KV cache and HF loading.

Public names here are a contract used by rollout, trainer and kernels.
"""

from trace_jax.models.attention import (
    Attention,
    KVCache,
    LayerKVCache,
    RMSNorm,
    apply_rope,
    cache_read,
    cache_write,
    init_cache,
    rope_angles,
)
from trace_jax.models.config import ModelConfig, QuantSite, SiteName, identity_site
from trace_jax.models.moe import (
    MoE,
    MoEImpl,
    PackedExperts,
    Routing,
    experts_dense,
    experts_grouped,
    experts_packed_fp4,
    pack_experts,
    route,
    switch_aux_loss,
)
from trace_jax.models.packed_kv_cache import PackedLayerKVCache, PackedTensorCache
from trace_jax.models.qwen3_moe import (
    DecoderLayer,
    Qwen3MoE,
    abstract_model,
    active_param_count,
    decode_step,
    decode_step_jit,
    forward_jit,
    init_model,
    pack_model_experts,
    param_count,
    prefill,
    prefill_jit,
)

__all__ = [
    "Attention",
    "DecoderLayer",
    "KVCache",
    "LayerKVCache",
    "MoE",
    "MoEImpl",
    "ModelConfig",
    "PackedExperts",
    "PackedLayerKVCache",
    "PackedTensorCache",
    "QuantSite",
    "Qwen3MoE",
    "RMSNorm",
    "Routing",
    "SiteName",
    "abstract_model",
    "active_param_count",
    "apply_rope",
    "cache_read",
    "cache_write",
    "decode_step",
    "decode_step_jit",
    "experts_dense",
    "experts_grouped",
    "experts_packed_fp4",
    "forward_jit",
    "identity_site",
    "init_cache",
    "init_model",
    "pack_experts",
    "pack_model_experts",
    "param_count",
    "prefill",
    "prefill_jit",
    "rope_angles",
    "route",
    "switch_aux_loss",
]
