"""Hugging Face Qwen3-MoE checkpoints: both config generations and the refusals, round trips,
sharded loading that reads only each device's block, and transformers parity both ways.

fixtures/qwen3_30b_a3b_config_hub.json is the Hub's Qwen3-30B-A3B `config.json` (transformers
4.51 keys: `num_experts`, top-level `rope_theta`, `torch_dtype`);
fixtures/qwen3_30b_a3b_config_transformers5.json is what transformers 5.24 writes for the same
model (`Qwen3MoeConfig(...).save_pretrained`: `num_local_experts`, `rope_parameters`, `dtype`).
"""

import collections
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests import tiny
from tests.models.rounding import (
    ELEMENTWISE,
    U32,
    assert_logits_agree,
    router_logits_bound,
    routing_decided,
)
from trace_jax.models import ModelConfig, init_model
from trace_jax.models.hf_checkpoint import (
    hf_tensor_shapes,
    load_hf_checkpoint,
    model_from_hf_tensors,
    model_to_hf_tensors,
    read_hf_config,
    save_hf_checkpoint,
)
from trace_jax.models.hf_files import (
    CONFIG_FILE,
    INDEX_FILE,
    CheckpointError,
    SafetensorsCheckpoint,
    load_hf_tensors,
)
from trace_jax.rl.sharding import make_mesh, param_sharding_rule, shard_model

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TOKENS = np.random.default_rng(0).integers(0, 64, (2, 9)).astype(np.int32)


def hf_config(generation: str) -> dict:
    return json.loads((FIXTURES / f"qwen3_30b_a3b_config_{generation}.json").read_text())


@pytest.fixture(autouse=True)
def highest_matmul_precision():
    """Exact float32 matmuls on every backend (GPUs default to TF32-like precision)."""
    with jax.default_matmul_precision("highest"):
        yield


# ------------------------------------------------------------------------------------ configs


@pytest.mark.parametrize("generation", ["hub", "transformers5"])
def test_both_config_generations_give_qwen3_30b_a3b(generation):
    hf = hf_config(generation)
    assert ("num_experts" in hf, "rope_theta" in hf) == ((generation == "hub"),) * 2
    assert ModelConfig.from_hf_config(hf) == ModelConfig.qwen3_5_35b_a3b()


@pytest.mark.parametrize(
    ("generation", "edit"),
    [
        ("hub", lambda hf: hf.update(rope_theta=5e5)),
        ("transformers5", lambda hf: hf["rope_parameters"].update(rope_theta=5e5)),
        ("transformers5", lambda hf: hf.update(rope_theta=5e5, rope_parameters=None)),
        ("hub", lambda hf: hf.update(rope_theta=None, rope_scaling={"rope_theta": 5e5})),
    ],
)
def test_the_rope_base_is_read_wherever_it_is_named(generation, edit):
    hf = hf_config(generation)
    edit(hf)
    assert ModelConfig.from_hf_config(hf).rope_theta == 5e5


def test_a_config_naming_no_rope_base_gets_transformers_default():
    hf = hf_config("transformers5")
    del hf["rope_parameters"]
    assert ModelConfig.from_hf_config(hf).rope_theta == 10_000.0


def test_to_hf_config_writes_transformers5_keys_and_the_older_names_alike():
    written = ModelConfig.qwen3_5_35b_a3b(param_dtype=jnp.bfloat16).to_hf_config()
    want = hf_config("transformers5")
    del want["transformers_version"], want["bos_token_id"], want["eos_token_id"]
    assert set(written) - set(want) == {"num_experts", "rope_theta", "bos_token_id", "eos_token_id"}
    assert {k: written[k] for k in want} == want
    assert written["num_experts"] == 128 and written["rope_theta"] == 1e6


@pytest.mark.parametrize(
    ("generation", "edit", "fragment"),
    [
        ("transformers5", dict(num_experts=64), r"'num_experts': 64, 'num_local_experts': 128"),
        ("hub", dict(torch_dtype="float32", dtype="bfloat16"), "one setting, two values"),
        ("hub", dict(rope_parameters={"rope_theta": 5e5}), "different RoPE bases"),
        (
            "transformers5",
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
            r"rope_type='yarn'.*keys \['factor'\]",
        ),
        ("hub", dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type='linear'"),
        ("hub", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
        ("hub", dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
        ("hub", dict(mlp_only_layers=[0, 1]), r"mlp_only_layers=\[0, 1\]"),
        ("transformers5", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
        ("hub", dict(attention_bias=True), "attention_bias"),
        ("hub", dict(attention_dropout=0.1), "attention_dropout=0.1"),
        ("hub", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("hub", dict(model_type="qwen2_moe"), "model_type='qwen2_moe'"),
        ("transformers5", dict(num_local_experts=None), "num_experts or num_local_experts"),
        ("hub", dict(num_experts_per_tok=200), "top_k=200"),
    ],
)
def test_unsupported_or_conflicting_configs_are_refused(generation, edit, fragment):
    hf = {**hf_config(generation), **edit}
    with pytest.raises(ValueError, match=fragment):
        ModelConfig.from_hf_config(hf)


# ---------------------------------------------------------------------------- checkpoint files


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
    assert {k: v.shape for k, v in tensors.items()} == hf_tensor_shapes(cfg)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # [H*Dh, D]
    assert tensors["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (64, 64)
    assert ("lm_head.weight" in tensors) != cfg.tie_embeddings
    loaded = load_hf_checkpoint(tmp_path, dtype=jnp.float32)
    assert loaded.cfg == cfg == read_hf_config(tmp_path, dtype=jnp.float32)
    got = model_to_hf_tensors(loaded)
    for key, want in model_to_hf_tensors(model).items():
        np.testing.assert_array_equal(got[key], want, err_msg=key)
    np.testing.assert_array_equal(model(TOKENS)[0], loaded(TOKENS)[0])


def test_bfloat16_checkpoint(tmp_path):
    cfg = tiny.model_config(dtype=jnp.float32)
    model = init_model(cfg, seed=5)
    save_hf_checkpoint(tmp_path, model, dtype=ml_dtypes.bfloat16)
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["dtype"] == "bfloat16"
    tensors = load_hf_tensors(tmp_path)
    assert tensors["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    loaded = load_hf_checkpoint(tmp_path, dtype=jnp.float32)
    assert loaded.embed[...].dtype == jnp.float32
    for key, value in model_to_hf_tensors(loaded).items():
        np.testing.assert_array_equal(value, tensors[key].astype(np.float32), err_msg=key)


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
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = np.zeros((8, 128, 64), np.float32)
    tensors["vision_tower.weight"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError) as err:
        model_from_hf_tensors(cfg, tensors)
    msg = str(err.value)
    for fragment in (
        "missing (2)",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.norm.weight",
        "unexpected (5)",
        "model.layers.4.mlp.gate.weight",
        "model.layers.0.mlp.experts.8.up_proj.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
        "gate_up_proj (no rule) (fused expert tensors: save with save_original_format=True)",
        "vision_tower.weight",
        "shape mismatch (2)",
        "model.layers.0.self_attn.k_proj.weight: got [64, 64], expected [32, 64]",
        "model.layers.2.mlp.experts.0.down_proj.weight: got [64, 65], expected [64, 64]",
    ):
        assert fragment in msg, (fragment, msg)


def test_a_tied_head_must_equal_the_embedding():
    cfg = tiny.model_config(tie_embeddings=True)
    tensors = model_to_hf_tensors(init_model(cfg))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    model_from_hf_tensors(cfg, tensors)  # an exporter's copy of the tied head is accepted
    tensors["lm_head.weight"][0, 0] += 1
    with pytest.raises(CheckpointError, match="differs from the tied embedding"):
        model_from_hf_tensors(cfg, tensors)


# --------------------------------------------------------------------------- sharded loading

# Placements that split tensors inside as well as across experts, on a (data=2, expert=4) mesh.
SPLIT_SPECS = {
    "embed": P("data"),  # [V, D]: vocabulary rows
    "lm_head": P(None, "expert"),  # [D, V]: HF [V, D] rows
    "layers.0.attn.w_q": P(None, "expert"),  # [D, H=4, Dh]: one head per device
    "layers.1.attn.w_k": P(None, "data"),  # [D, Hkv=2, Dh]
    "layers.0.attn.w_o": P("expert"),  # [H, Dh, D]: HF [D, H*Dh] columns
    "layers.1.moe.router": P(None, "expert"),  # [D, E]: HF [E, D] rows
    "layers.0.moe.w_gate": P("expert", "data"),  # [E, F, D]: experts, then F within each
    "layers.1.moe.w_down": P("expert"),  # [E, D, F]
}


def flat_params(model) -> dict[str, jax.Array]:
    """Dotted path ("layers.0.moe.w_gate") -> array of every parameter."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, p)): v.get_value() for p, v in flat}


def heads(h: tuple[int, int], c: tuple[int, int]) -> tuple[int, int]:
    """The HF rows (or columns) of heads [h0, h1) when a device holds them whole (c = [0, Dh))."""
    return (h[0] * c[1], h[1] * c[1])


def expected_reads(cfg, mesh) -> collections.Counter:
    """(HF key, [start, stop) per HF axis) of every read that loading with SPLIT_SPECS (the rest
    replicated) must make: each distinct device block once, and nothing else."""
    shapes = hf_tensor_shapes(cfg)
    reads = collections.Counter({(k, tuple((0, n) for n in s)): 1 for k, s in shapes.items()})
    attn, moe = "model.layers.{}.self_attn.", "model.layers.{}.mlp."
    expert = moe + "experts.{}.{}.weight"
    d, v, h, hkv, c, e = (cfg.d_model, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads,
                          cfg.head_dim, cfg.n_experts)  # fmt: skip
    f = cfg.d_ff_expert
    # model path: (model shape, the HF reads of a model block given as [start, stop) per axis)
    split = {
        "embed": ((v, d), lambda vs, ds: [("model.embed_tokens.weight", (vs, ds))]),
        "lm_head": ((d, v), lambda ds, vs: [("lm_head.weight", (vs, ds))]),
        "layers.0.attn.w_q": (
            (d, h, c),
            lambda ds, hs, cs: [(attn.format(0) + "q_proj.weight", (heads(hs, cs), ds))],
        ),
        "layers.1.attn.w_k": (
            (d, hkv, c),
            lambda ds, hs, cs: [(attn.format(1) + "k_proj.weight", (heads(hs, cs), ds))],
        ),
        "layers.0.attn.w_o": (
            (h, c, d),
            lambda hs, cs, ds: [(attn.format(0) + "o_proj.weight", (ds, heads(hs, cs)))],
        ),
        "layers.1.moe.router": ((d, e), lambda ds, es: [(moe.format(1) + "gate.weight", (es, ds))]),
        "layers.0.moe.w_gate": (
            (e, f, d),
            lambda es, fs, ds: [(expert.format(0, j, "gate_proj"), (fs, ds)) for j in range(*es)],
        ),
        "layers.1.moe.w_down": (
            (e, d, f),
            lambda es, ds, fs: [(expert.format(1, j, "down_proj"), (ds, fs)) for j in range(*es)],
        ),
    }
    for path, (shape, hf_reads) in split.items():
        for key, whole in hf_reads(*((0, n) for n in shape)):
            del reads[(key, whole)]
        indices = NamedSharding(mesh, SPLIT_SPECS[path]).devices_indices_map(shape).values()
        blocks = {tuple(s.indices(n)[:2] for s, n in zip(i, shape, strict=True)) for i in indices}
        for block in blocks:
            reads.update(hf_reads(*block))
    return reads


def test_sharded_load_reads_only_each_devices_block(tmp_path, monkeypatch):
    assert jax.device_count() == 8, "conftest sets 8 host devices"
    cfg = tiny.model_config(dtype=jnp.float32, init_std=0.1)
    save_hf_checkpoint(tmp_path, init_model(cfg, seed=7), n_shards=3, dtype=ml_dtypes.bfloat16)
    full = flat_params(load_hf_checkpoint(tmp_path, dtype=jnp.float32))
    mesh = make_mesh(2, 4)
    shardings = {path: NamedSharding(mesh, SPLIT_SPECS.get(path, P())) for path in full}
    reads = collections.Counter()
    read = SafetensorsCheckpoint.read

    def recorded(self, key, index):
        bounds = [s.indices(n)[:2] for s, n in zip(index, self.shape(key), strict=True)]
        reads[(key, tuple(bounds) if index else tuple((0, n) for n in self.shape(key)))] += 1
        return read(self, key, index)

    monkeypatch.setattr(SafetensorsCheckpoint, "read", recorded)
    sharded = flat_params(load_hf_checkpoint(tmp_path, shardings=shardings, dtype=jnp.float32))
    assert reads == expected_reads(cfg, mesh)
    assert sharded.keys() == full.keys()
    for path, got in sharded.items():
        assert got.sharding == shardings[path], path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(full[path]), err_msg=path)


def test_load_with_the_rl_placement_equals_placing_after_a_full_load(tmp_path):
    cfg = tiny.model_config(dtype=jnp.float32)
    model = init_model(cfg, seed=8)
    save_hf_checkpoint(tmp_path, model)
    mesh = make_mesh(2, 4)
    loaded = load_hf_checkpoint(tmp_path, shardings=param_sharding_rule(mesh), dtype=jnp.float32)
    shard_model(model, mesh)
    for (path, got), (_, want) in zip(
        jax.tree.leaves_with_path(loaded), jax.tree.leaves_with_path(model), strict=True
    ):
        assert got.sharding == want.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert loaded.layers[0].moe.w_up[...].sharding.spec == P("expert")
    with pytest.raises(ValueError, match="no sharding for parameter 'embed'"):
        load_hf_checkpoint(tmp_path, shardings={}, dtype=jnp.float32)


# ------------------------------------------------------------------------------ transformers


def assert_matches_transformers(model, hf, torch) -> None:
    """Logits and per-layer router probabilities of `model` and the transformers model `hf` on
    TOKENS agree to float32 rounding."""
    with torch.no_grad():
        out = hf(torch.from_numpy(TOKENS).long(), output_router_logits=True)
    logits, aux = model(TOKENS)
    # Two float32 implementations summing in their own orders: no token is near a routing tie,
    # so both route alike, and they differ by rounding only.
    t, n_experts = TOKENS.shape[1], model.cfg.n_experts
    assert routing_decided(model, aux["router_probs"], t).all()
    assert_logits_agree(model, logits, out.logits.float().numpy(), t)
    assert len(out.router_logits) == model.cfg.n_layers
    for i, router_logits in enumerate(out.router_logits):
        probs = torch.softmax(router_logits.float(), dim=-1).numpy().astype(np.float64)
        ours = np.asarray(aux["router_probs"][i], np.float64).reshape(-1, n_experts)
        # A softmax moves by at most p_e * 2 max|d logit|; each side's logits within
        # router_logits_bound of exact, plus the softmax's own rounding.
        rel = 4 * router_logits_bound(model, t)[i] + 2 * (n_experts + ELEMENTWISE) * U32
        assert np.all(np.abs(ours - probs) <= rel * np.maximum(ours, probs)), i


def test_our_checkpoint_loads_into_transformers(tmp_path):
    torch = pytest.importorskip("torch", reason="needs torch for the Hugging Face reference")
    transformers = pytest.importorskip(
        "transformers", reason="needs transformers for the Hugging Face reference"
    )
    model = init_model(tiny.model_config(dtype=jnp.float32, init_std=0.1), seed=6)
    save_hf_checkpoint(tmp_path, model)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert hf.config.num_experts == 8 and hf.config.rope_parameters["rope_theta"] == 1e6
    assert_matches_transformers(model, hf, torch)


def older_keys(hf: dict) -> dict:
    """A transformers-5 config dict in the older generation's keys."""
    hf = dict(hf)
    hf["num_experts"] = hf.pop("num_local_experts")
    hf["rope_theta"] = hf.pop("rope_parameters")["rope_theta"]
    hf["torch_dtype"] = hf.pop("dtype")
    return hf


@pytest.mark.parametrize("generation", ["transformers5", "older_keys"])
def test_transformers_checkpoint_loads_into_ours(tmp_path, generation):
    torch = pytest.importorskip("torch", reason="needs torch for the Hugging Face reference")
    transformers = pytest.importorskip(
        "transformers", reason="needs transformers for the Hugging Face reference"
    )
    torch.manual_seed(0)
    # RoPE base 5e5 is neither side's default: the logits show it was read.
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=tiny.N_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}, initializer_range=0.1,
    )  # fmt: skip
    transformers.Qwen3MoeForCausalLM(hf_cfg).float().save_pretrained(tmp_path)
    written = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert written["num_local_experts"] == 8 and "num_experts" not in written
    if generation == "older_keys":
        (tmp_path / CONFIG_FILE).write_text(json.dumps(older_keys(written)))
    checkpoint = SafetensorsCheckpoint(tmp_path)  # transformers writes per-expert tensors
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in checkpoint.keys()
    model = load_hf_checkpoint(tmp_path, dtype=jnp.float32)
    assert model.cfg == tiny.model_config(dtype=jnp.float32, init_std=0.1, rope_theta=5e5)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert_matches_transformers(model, hf, torch)
