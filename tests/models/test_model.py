"""Full-sequence forward: outputs, quantization sites, replay, padding, gradients."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.rounding import assert_logits_agree, routing_decided
from trace_jax.models import ModelConfig, Qwen3MoE, SiteName, forward_jit, init_model

B, T = 2, 7
CFG32 = ModelConfig.tiny(dtype=jnp.float32, init_std=0.1)
# One worker runs the module: its tests share the model fixtures and compiled forwards.
pytestmark = pytest.mark.xdist_group("model")


@pytest.fixture(autouse=True)
def highest_matmul_precision():
    """Exact float32 matmuls on every backend (GPUs default to TF32-like precision)."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model() -> Qwen3MoE:
    return init_model(CFG32, seed=0)


@pytest.fixture(scope="module")
def tokens() -> jax.Array:
    return jax.random.randint(jax.random.key(7), (B, T), 0, CFG32.vocab_size, jnp.int32)


def test_forward_shapes_and_dtypes(tokens):
    cfg = ModelConfig.tiny()  # bfloat16 compute
    model = init_model(cfg, seed=1)
    logits, aux = model(tokens)
    L, K, E = cfg.n_layers, cfg.top_k, cfg.n_experts
    assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
    assert aux["topk_idx"].shape == (L, B, T, K) and aux["topk_idx"].dtype == jnp.int32
    assert aux["topk_weights"].shape == (L, B, T, K)
    assert aux["router_probs"].shape == (L, B, T, E)
    assert aux["router_aux_loss"].shape == () and aux["router_aux_loss_per_layer"].shape == (L,)
    assert np.isfinite(np.asarray(logits)).all()
    # Uniform-ish router at init: the Switch loss is near K.
    np.testing.assert_allclose(aux["router_aux_loss"], K, rtol=0.2)


def test_sites_called_with_documented_names_and_shapes(model, tokens):
    calls = []

    def record(x, *, name, layer, experts=None):
        assert isinstance(layer, int) and isinstance(name, str)
        calls.append((str(name), layer, tuple(x.shape), x.dtype))
        return x

    cfg = CFG32
    model(tokens, site=record)
    expected = {
        "expert_in": (B, T, cfg.d_model),
        "expert_mid": (B, T, cfg.top_k, cfg.d_ff_expert),
        "w_gate": (cfg.n_experts, cfg.d_ff_expert, cfg.d_model),
        "w_up": (cfg.n_experts, cfg.d_ff_expert, cfg.d_model),
        "w_down": (cfg.n_experts, cfg.d_model, cfg.d_ff_expert),
        "k": (B, T, cfg.n_kv_heads, cfg.head_dim),
        "v": (B, T, cfg.n_kv_heads, cfg.head_dim),
    }
    assert set(expected) == {s.value for s in SiteName}
    want = collections.Counter(
        (name, layer, shape, cfg.dtype)
        for name, shape in expected.items()
        for layer in range(cfg.n_layers)
    )
    assert collections.Counter(calls) == want


def scale_one_site(x, *, name, layer, target, experts=None):
    return x * 1.5 if name == target and layer == 2 else x


def test_every_site_affects_output(model, tokens):
    ref, _ = model(tokens)
    for target in SiteName:
        out, _ = model(tokens, site=functools.partial(scale_one_site, target=target))
        assert not np.allclose(out, ref), f"site {target} had no effect"


def test_grouped_matches_dense_model(model, tokens):
    logits, aux = model(tokens)
    dense, aux_d = model(tokens, moe_impl="dense", expert_choices=aux["topk_idx"])
    assert_logits_agree(model, dense, logits, T)
    np.testing.assert_array_equal(aux["topk_idx"], aux_d["topk_idx"])


def test_replay_own_choices_exact(model, tokens):
    logits, aux = model(tokens)
    replay, aux_r = model(tokens, expert_choices=aux["topk_idx"])
    np.testing.assert_array_equal(logits, replay)
    np.testing.assert_array_equal(aux["topk_weights"], aux_r["topk_weights"])
    with pytest.raises(ValueError, match=r"expert_choices has shape"):
        model(tokens, expert_choices=aux["topk_idx"][:2])


def test_padding_either_side_matches_unpadded(model, tokens):
    n = 4  # real tokens of row 0
    ref, aux = model(tokens[:1, :n])
    pad = jnp.zeros((1, T - n), jnp.int32)
    valid = jnp.arange(T) < n
    right, aux_r = model(jnp.concatenate([tokens[:1, :n], pad], 1), mask=valid[None])
    left, aux_l = model(jnp.concatenate([pad, tokens[:1, :n]], 1), mask=valid[::-1][None])
    # No token is near a routing tie, so all three route alike and differ only by rounding.
    assert routing_decided(model, aux["router_probs"], T).all()
    np.testing.assert_array_equal(aux_r["topk_idx"][:, :, :n], aux["topk_idx"])
    np.testing.assert_array_equal(aux_l["topk_idx"][:, :, T - n :], aux["topk_idx"])
    assert_logits_agree(model, right[:, :n], ref, T)
    assert_logits_agree(model, left[:, T - n :], ref, T)
    assert np.isfinite(np.asarray(left)).all()


def test_forward_jit_matches_eager(model, tokens):
    graphdef, params = nnx.split(model)
    ref, aux = model(tokens)
    out, aux_j = forward_jit(graphdef, params, tokens)
    # Expert choices are discrete: equal where no token is near a routing tie (all of them here).
    assert routing_decided(model, aux["router_probs"], T).all()
    np.testing.assert_array_equal(aux["topk_idx"], aux_j["topk_idx"])
    assert_logits_agree(model, out, ref, T)


def test_gradients_flow(tokens):
    cfg = ModelConfig.tiny(dtype=jnp.float32, shared_expert_d_ff=16)
    model = init_model(cfg, seed=2)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params):
        logits, aux = nnx.merge(graphdef, params)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
        return nll + cfg.router_aux_loss_coef * aux["router_aux_loss"]

    grads = jax.jit(jax.grad(loss_fn))(params)
    flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    assert all(np.isfinite(g).all() for g in flat.values())
    for name in (
        "embed",
        "lm_head",
        "final_norm.scale",
        "layers.0.attn.w_q",
        "layers.0.attn.w_k",
        "layers.0.attn.k_norm.scale",
        "layers.0.moe.router",
        "layers.0.moe.w_gate",
        "layers.0.moe.w_down",
        "layers.3.moe.shared.w_up",
        "layers.3.moe.shared_gate",
    ):
        assert np.abs(flat[name]).max() > 0, name
