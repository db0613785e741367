"""safetensors reader/writer and Hugging Face Qwen3-MoE checkpoint loading."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.models.rounding import (
    ELEMENTWISE,
    U32,
    assert_logits_agree,
    router_logits_bound,
    routing_decided,
)
from trace_jax.models import ModelConfig, init_model
from trace_jax.models.hf_checkpoint import (
    INDEX_FILE,
    CheckpointError,
    load_hf_checkpoint,
    load_hf_tensors,
    model_from_hf_tensors,
    model_to_hf_tensors,
    read_safetensors,
    read_safetensors_header,
    save_hf_checkpoint,
    write_safetensors,
)

TOKENS = np.random.default_rng(0).integers(0, 64, (2, 9)).astype(np.int32)


@pytest.fixture(autouse=True)
def highest_matmul_precision():
    """Exact float32 matmuls on every backend (GPUs default to TF32-like precision)."""
    with jax.default_matmul_precision("highest"):
        yield


def test_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "f32": rng.normal(size=(3, 5)).astype(np.float32),
        "f16": rng.normal(size=(7,)).astype(np.float16),
        "bf16": rng.normal(size=(2, 3, 4)).astype(ml_dtypes.bfloat16),
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
        "big_endian": np.arange(4, dtype=">f4"),
    }
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt", "note": "x"})
    header, start = read_safetensors_header(path)
    assert start % 8 == 0 and header["__metadata__"]["note"] == "x"
    assert header["bf16"]["dtype"] == "BF16" and header["f16"]["shape"] == [7]
    back = read_safetensors(path)
    assert set(back) == set(tensors)
    for name, arr in tensors.items():
        assert back[name].dtype == arr.dtype.newbyteorder("<"), name
        np.testing.assert_array_equal(back[name], arr)
    assert set(read_safetensors(path, keys=["f16"])) == {"f16"}
    with pytest.raises(KeyError, match="nope"):
        read_safetensors(path, keys=["nope"])


def test_safetensors_rejects_bad_files(tmp_path):
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, {"x": np.ones((4, 4), np.float32)})
    path.write_bytes(path.read_bytes()[:-8])  # truncated data
    with pytest.raises(CheckpointError, match="'x'"):
        read_safetensors(path)
    path.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        read_safetensors(path)
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(path, {"c": np.zeros(2, np.complex64)})


@pytest.mark.parametrize(
    ("n_shards", "overrides"),
    [(1, {}), (2, dict(shared_expert_d_ff=32)), (2, dict(tie_embeddings=True))],
)
def test_checkpoint_round_trip(tmp_path, n_shards, overrides):
    cfg = ModelConfig.tiny(dtype=jnp.float32, init_std=0.1, **overrides)
    model = init_model(cfg, seed=4)
    save_hf_checkpoint(tmp_path, model, n_shards=n_shards)
    assert (tmp_path / INDEX_FILE).exists() == (n_shards > 1)
    tensors = load_hf_tensors(tmp_path)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # [H*Dh, D]
    assert tensors["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (64, 64)
    assert ("lm_head.weight" in tensors) != cfg.tie_embeddings
    loaded = load_hf_checkpoint(tmp_path, dtype=jnp.float32)
    assert loaded.cfg == cfg
    for (_, a), (_, b) in zip(
        jax.tree.leaves_with_path(model_to_hf_tensors(model)),
        jax.tree.leaves_with_path(model_to_hf_tensors(loaded)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(model(TOKENS)[0], loaded(TOKENS)[0])


def test_bfloat16_checkpoint(tmp_path):
    cfg = ModelConfig.tiny(dtype=jnp.float32)
    model = init_model(cfg, seed=5)
    save_hf_checkpoint(tmp_path, model, dtype=ml_dtypes.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = load_hf_tensors(tmp_path)
    assert tensors["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    loaded = load_hf_checkpoint(tmp_path, dtype=jnp.float32)
    rounded = model_from_hf_tensors(
        cfg, {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in tensors.items()}
    )
    assert loaded.embed[...].dtype == jnp.float32
    np.testing.assert_array_equal(loaded(TOKENS)[0], rounded(TOKENS)[0])


def test_all_problems_reported_together():
    cfg = ModelConfig.tiny()
    tensors = dict(model_to_hf_tensors(init_model(cfg)))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    tensors["model.layers.2.mlp.experts.0.down_proj.weight"] = np.zeros((64, 65), np.float32)
    tensors["model.layers.4.mlp.gate.weight"] = np.zeros((8, 64), np.float32)
    tensors["model.layers.0.mlp.experts.8.up_proj.weight"] = np.zeros((64, 64), np.float32)
    tensors["model.layers.0.mlp.shared_expert_gate.weight"] = np.zeros((1, 64), np.float32)
    tensors["vision_tower.weight"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError) as err:
        model_from_hf_tensors(cfg, tensors)
    msg = str(err.value)
    for fragment in (
        "missing (2)",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.norm.weight",
        "unexpected (4)",
        "model.layers.4.mlp.gate.weight",
        "model.layers.0.mlp.experts.8.up_proj.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
        "vision_tower.weight",
        "shape mismatch (2)",
        "model.layers.0.self_attn.k_proj.weight: got [64, 64], expected [32, 64]",
        "model.layers.2.mlp.experts.0.down_proj.weight: got [64, 65], expected [64, 64]",
    ):
        assert fragment in msg, (fragment, msg)


def test_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch", reason="needs torch for the Hugging Face reference")
    transformers = pytest.importorskip(
        "transformers", reason="needs transformers for the Hugging Face reference"
    )
    cfg = ModelConfig.tiny(dtype=jnp.float32, init_std=0.1)
    model = init_model(cfg, seed=6)
    save_hf_checkpoint(tmp_path, model)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = hf(torch.from_numpy(TOKENS).long(), output_router_logits=True)
    logits, aux = model(TOKENS)
    # Two float32 implementations summing in their own orders: no token is near a routing tie,
    # so both route alike, and they differ by rounding only.
    t = TOKENS.shape[1]
    assert routing_decided(model, aux["router_probs"], t).all()
    assert_logits_agree(model, logits, out.logits.float().numpy(), t)
    for i, router_logits in enumerate(out.router_logits):
        probs = torch.softmax(router_logits.float(), dim=-1).numpy().astype(np.float64)
        ours = np.asarray(aux["router_probs"][i], np.float64).reshape(-1, cfg.n_experts)
        # A softmax moves by at most p_e * 2 max|d logit|; each side's logits within
        # router_logits_bound of exact, plus the softmax's own rounding.
        rel = 4 * router_logits_bound(model, t)[i] + 2 * (cfg.n_experts + ELEMENTWISE) * U32
        assert np.all(np.abs(ours - probs) <= rel * np.maximum(ours, probs)), i
