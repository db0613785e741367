"""ModelConfig: validation, presets, Hugging Face config mapping, shape-only parameter counts;
the forward call's kernel choice (the rollout's "auto" setting, the expert matmul's order)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kernels_pallas import common
from kernels_pallas.fp4_moe_matmul import api as fp4_moe_matmul_api
from trace_jax.models import (
    ModelConfig,
    abstract_model,
    active_param_count,
    expert_kernel_order,
    init_model,
    kernel_order,
    param_count,
    resolve_implementation,
)
from trace_jax.models.backends import prefill_attention_order

# Qwen3-30B-A3B config.json (the fields that matter), as published by Qwen.
QWEN3_30B_A3B_HF = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def expected_param_count(cfg: ModelConfig) -> int:
    d, h, n, c = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn = d * h * c * 2 + d * n * c * 2 + 2 * c
    moe = d * cfg.n_experts + 3 * cfg.n_experts * cfg.d_ff_expert * d
    if cfg.shared_expert_d_ff:
        moe += 3 * d * cfg.shared_expert_d_ff + (d if cfg.shared_expert_gated else 0)
    per_layer = attn + moe + 2 * d
    head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
    return cfg.vocab_size * d + cfg.n_layers * per_layer + d + head


def test_presets_sizes():
    tiny, small = ModelConfig.tiny(), ModelConfig.small()
    assert param_count(tiny) == expected_param_count(tiny) < 1_000_000
    assert 10_000_000 < param_count(small) == expected_param_count(small) < 100_000_000
    assert tiny.dtype == jnp.bfloat16 and tiny.param_dtype == jnp.float32


def test_paper_preset_param_count_by_eval_shape():
    cfg = ModelConfig.qwen3_5_35b_a3b()
    abstract = abstract_model(cfg)
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert abstract.layers[0].moe.w_down.shape == (128, 2048, 768)
    n = param_count(cfg)
    assert n == expected_param_count(cfg)
    assert 30.0e9 < n < 31.0e9  # Qwen3-30B-A3B: 30.5B total
    assert 3.0e9 < active_param_count(cfg) < 3.6e9  # 3.3B active


def test_presets_are_derived_and_overridable():
    cfg = ModelConfig.small(dtype=jnp.float32, n_layers=2)
    assert cfg.n_layers == 2 and cfg.dtype == jnp.float32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 3  # type: ignore[misc]
    assert hash(cfg) == hash(ModelConfig.small(dtype=jnp.float32, n_layers=2))


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (dict(n_heads=6, n_kv_heads=4), "n_heads=6"),
        (dict(top_k=9), "top_k=9"),
        (dict(d_model=0), "d_model"),
        (dict(vocab_size=-3), "vocab_size"),
        (dict(n_layers=2.0), "n_layers"),
        (dict(head_dim=15), "head_dim"),
        (dict(shared_expert_d_ff=-1), "shared_expert_d_ff"),
        (dict(rms_eps=0.0), "rms_eps"),
        (dict(rope_theta=float("inf")), "rope_theta"),
        (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef"),
        (dict(dtype=jnp.int32), "dtype"),
        (dict(param_dtype="not-a-dtype"), "param_dtype"),
        (dict(grouped_matmul="megablox"), "grouped_matmul"),
        (dict(prefill_attention="flash"), r"prefill_attention must be one of \['xla'"),
        (dict(predecode_experts="yes"), "predecode_experts must be None, True or False"),
    ],
)
def test_invalid_configs_raise(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        ModelConfig.tiny(**overrides)


@pytest.mark.parametrize("name", ["ragged_dot", "tiled", "pallas", "auto"])
def test_every_grouped_matmul_is_a_valid_setting(name):
    assert ModelConfig.tiny(grouped_matmul=name).grouped_matmul == name


def test_from_hf_config_qwen3_30b():
    cfg = ModelConfig.from_hf_config(QWEN3_30B_A3B_HF)
    assert cfg == ModelConfig.qwen3_5_35b_a3b()


def test_hf_config_round_trip():
    cfg = ModelConfig.tiny(shared_expert_d_ff=32, tie_embeddings=True, norm_topk_prob=False)
    back = ModelConfig.from_hf_config(cfg.to_hf_config())
    assert back == cfg


def test_from_hf_config_errors():
    hf = dict(QWEN3_30B_A3B_HF)
    del hf["num_experts"]
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf_config(hf)
    hf = dict(QWEN3_30B_A3B_HF, mlp_only_layers=[0, 1], rope_scaling={"type": "yarn"})
    with pytest.raises(ValueError, match=r"mlp_only_layers.*rope_scaling"):
        ModelConfig.from_hf_config(hf)
    hf = dict(QWEN3_30B_A3B_HF, num_experts_per_tok=200)
    with pytest.raises(ValueError, match="top_k=200"):
        ModelConfig.from_hf_config(hf)


@pytest.mark.parametrize(
    ("platform", "want"), [("cpu", "xla"), ("gpu", "pallas"), ("tpu", "pallas")]
)
def test_auto_implementation_is_pallas_where_it_compiles(platform, want):
    with common.lowering_for(platform):
        assert resolve_implementation("auto") == want
    assert resolve_implementation("xla") == "xla" and resolve_implementation("pallas") == "pallas"
    with pytest.raises(ValueError, match=r"one of \['auto', 'pallas', 'xla'\], got 'cuda'"):
        resolve_implementation("cuda")


def test_pallas_kernel_order_needs_native_pallas_or_interpretation():
    """The model's "pallas" on the CPU raises (naming the platform and how to interpret) rather
    than run every op's XLA fallback unseen; interpreted, or built for a TPU, it runs."""
    with pytest.raises(common.PallasUnavailableError, match=r"platform 'cpu'.*interpret"):
        kernel_order("pallas")
    with pytest.raises(NotImplementedError):
        expert_kernel_order("pallas")
    with common.interpreting(True):
        assert kernel_order("pallas") == ("pallas", "xla")
    with common.lowering_for("tpu"):
        assert kernel_order("pallas") == ("pallas", "xla")
    assert kernel_order("xla") == ("xla",)


@pytest.mark.usefixtures("pallas_interpreted_on_cpu")
@pytest.mark.parametrize(
    ("capability", "pallas_order"),
    [
        (0.0, ("pallas", "xla")),  # the CPU (interpret mode)
        (9.0, ("pallas", "xla")),  # Hopper: no FP4 tensor cores
        (10.0, ("scaled_matmul", "pallas", "xla")),  # Blackwell: cuDNN's block-scaled matmul
    ],
)
def test_expert_matmul_leads_with_native_fp4_where_the_gpu_has_it(
    monkeypatch, capability, pallas_order
):
    """The fp4_moe_matmul api's own compute capability decides; the other kernel ops keep
    `kernel_order`, and the XLA implementation stays XLA alone."""
    monkeypatch.setattr(fp4_moe_matmul_api, "_compute_capability", lambda: capability)
    assert expert_kernel_order("pallas") == pallas_order
    assert expert_kernel_order("xla") == ("xla",)
    assert kernel_order("pallas") == ("pallas", "xla")


@pytest.mark.parametrize(
    ("platform", "auto"),
    [("cpu", ("xla",)), ("gpu", ("pallas", "xla")), ("tpu", ("pallas", "xla"))],
)
def test_prefill_attention_auto_is_the_kernel_where_pallas_compiles(platform, auto):
    """The "auto" setting: the flash kernel on a GPU or a TPU, XLA's attention on the CPU;
    "pallas" is `kernel_order`'s (an error on the CPU unless interpreted); "xla" is XLA's
    everywhere."""
    with common.lowering_for(platform):
        assert prefill_attention_order("auto") == auto
        assert prefill_attention_order("xla") == ("xla",)
        if platform != "cpu":
            assert prefill_attention_order("pallas") == ("pallas", "xla")
            # cuDNN serves chunks from slot 0 (the attention layer's choice), the kernel the rest.
            assert prefill_attention_order("cudnn") == ("pallas", "xla")
    for setting in ("pallas", "cudnn"):
        with pytest.raises(common.PallasUnavailableError):
            prefill_attention_order(setting)
    assert ModelConfig.tiny().prefill_attention == "xla"  # until timed on a GPU


def test_prefill_attention_setting_leaves_the_forward_alone():
    """ "pallas" concerns prefill chunks only: the teacher-forced forward (the trainer's) runs on
    the CPU without interpretation, where asking for the kernel would raise."""
    cfg = ModelConfig.tiny(n_layers=1, prefill_attention="pallas")
    logits, _ = init_model(cfg, seed=0)(jnp.ones((1, 4), jnp.int32))
    assert logits.shape == (1, 4, cfg.vocab_size)
