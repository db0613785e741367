"""Router, Switch aux loss and routed experts: grouped (ragged_dot) path vs the dense reference;
which FP4 expert matmul the rollout's MoE call runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core

from kernels_pallas.fp4_moe_matmul import api as fp4_moe_matmul_api
from kernels_pallas.fp4_moe_matmul import fp4_moe_matmul_with_implementation
from tests.models.rounding import U32, experts_bound
from trace_jax.models import ModelConfig, MoE, Routing, pack_experts, route, switch_aux_loss
from trace_jax.models import moe as moe_module
from trace_jax.quant import QuantConfig, QuantSites, SiteMode

B, T = 2, 5


@pytest.fixture(autouse=True)
def highest_matmul_precision():
    """Exact float32 matmuls on every backend (GPUs default to TF32-like precision)."""
    with jax.default_matmul_precision("highest"):
        yield


def make_moe(**overrides) -> tuple[ModelConfig, MoE, jax.Array]:
    cfg = ModelConfig.tiny(dtype=jnp.float32, init_std=0.1, **overrides)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.d_model), jnp.float32)
    return cfg, moe, x


def smooth_site(x, *, name, layer, experts=None):
    """A nonlinear, order-sensitive stand-in for a quantizer (no rounding, so no flaky ties);
    its slope is at most `smooth_slope(layer)`."""
    return x + 0.1 * jnp.tanh(x * (layer + 1)) + 0.01 * len(name)


def smooth_slope(layer: int) -> float:
    return 1 + 0.1 * (layer + 1)


def assert_experts_agree(moe, x, routing, y_a, y_b, *, layer, site):
    """Two float32 computations of the routed experts (the same routing) differ by at most the sum
    of their rounding bounds (`experts_bound`: n u sum|products| at each dot, carried through
    silu, the site and the top-k combine), plus one rounding each of the final add of the shared
    expert (computed identically by both)."""
    if site is None:
        x_in, mid, slope = x, None, 1.0
    else:
        x_in = site(x, name="expert_in", layer=layer)
        mid, slope = (lambda h: site(h, name="expert_mid", layer=layer)), smooth_slope(layer)
    _, bound = experts_bound(moe, x_in, routing, mid_site=mid, mid_slope=slope)
    y_a, y_b = (np.asarray(y, np.float64) for y in (y_a, y_b))
    bound = 2 * bound + U32 * (np.abs(y_a) + np.abs(y_b))
    err = np.abs(y_a - y_b)
    worst = float(np.max(err / bound))
    assert worst <= 1, f"max |error| {err.max():.3g}: {worst:.3g} x the rounding bound"


@pytest.mark.parametrize("shared", [0, 32])
@pytest.mark.parametrize("site", [None, smooth_site])
def test_grouped_matches_dense(shared, site):
    _, moe, x = make_moe(shared_expert_d_ff=shared)
    kw = {} if site is None else {"site": site}
    y_g, r_g, aux_g = moe(x, layer=1, impl="grouped", **kw)
    y_d, r_d, aux_d = moe(x, layer=1, impl="dense", **kw)
    np.testing.assert_array_equal(r_g.topk_idx, r_d.topk_idx)
    assert_experts_agree(moe, x, r_g, y_g, y_d, layer=1, site=site)
    np.testing.assert_array_equal(aux_g, aux_d)
    assert float(jnp.abs(y_g).max()) > 1e-3


def test_grouped_matches_dense_with_empty_experts():
    _, moe, x = make_moe()
    choices = jnp.stack([jnp.zeros((B, T), jnp.int32), jnp.full((B, T), 5, jnp.int32)], -1)
    y_g, r, _ = moe(x, layer=0, expert_choices=choices, impl="grouped", site=smooth_site)
    y_d, _, _ = moe(x, layer=0, expert_choices=choices, impl="dense", site=smooth_site)
    np.testing.assert_array_equal(r.topk_idx, choices)
    assert_experts_agree(moe, x, r, y_g, y_d, layer=0, site=smooth_site)


def test_expert_mid_is_in_token_slot_order():
    """The "expert_mid" site sees h[b, t, k] = silu(x W_gate[e]^T) * (x W_up[e]^T), e = idx."""
    cfg, moe, x = make_moe()
    seen = {}

    def record(v, *, name, layer, experts=None):
        seen[name] = v
        return v

    _, routing, _ = moe(x, layer=0, site=record)
    e = routing.topk_idx  # [B, T, K]
    wg, wu = moe.w_gate[...][e], moe.w_up[...][e]  # [B, T, K, F, D]
    h = jax.nn.silu(jnp.einsum("btd,btkfd->btkf", x, wg)) * jnp.einsum("btd,btkfd->btkf", x, wu)
    assert seen["expert_mid"].shape == (B, T, cfg.top_k, cfg.d_ff_expert)
    # Both within experts_bound's rounding bound of exact h (a slot or token out of order is
    # off by O(|h|)).
    h_bound, _ = experts_bound(moe, x, routing)
    err = np.abs(np.asarray(seen["expert_mid"], np.float64) - np.asarray(h, np.float64))
    assert np.all(err <= 2 * h_bound), float(np.max(err / (2 * h_bound)))
    assert seen["w_gate"].shape == seen["w_up"].shape == (8, cfg.d_ff_expert, cfg.d_model)
    assert seen["w_down"].shape == (8, cfg.d_model, cfg.d_ff_expert)
    assert seen["expert_in"].shape == (B, T, cfg.d_model)


def test_replay_of_own_choices_is_exact():
    _, moe, x = make_moe(shared_expert_d_ff=16)
    y, routing, aux = moe(x, layer=0)
    y2, routing2, aux2 = moe(x, layer=0, expert_choices=routing.topk_idx)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(routing.topk_weights, routing2.topk_weights)
    np.testing.assert_array_equal(aux, aux2)


def test_replay_other_choices_uses_router_probs():
    cfg, moe, x = make_moe()
    _, routing, _ = moe(x, layer=0)
    other = (routing.topk_idx + 3) % cfg.n_experts
    _, replay, _ = moe(x, layer=0, expert_choices=other)
    np.testing.assert_array_equal(replay.topk_idx, other)
    p = jnp.take_along_axis(routing.probs, other, axis=-1)
    np.testing.assert_allclose(replay.topk_weights, p / p.sum(-1, keepdims=True), rtol=1e-6)
    with pytest.raises(ValueError, match="expert_choices has shape"):
        moe(x, layer=0, expert_choices=other[..., :1])


def test_route_topk_and_normalization():
    logits = jnp.array([[[2.0, 1.0, 0.5, -1.0]]])
    probs = jax.nn.softmax(logits, -1)
    r = route(logits, top_k=2, norm_topk_prob=False)
    np.testing.assert_array_equal(r.topk_idx, [[[0, 1]]])
    np.testing.assert_allclose(r.topk_weights, probs[..., :2], rtol=1e-6)
    r = route(logits, top_k=2, norm_topk_prob=True)
    np.testing.assert_allclose(r.topk_weights.sum(-1), 1.0, rtol=1e-6)
    assert r.topk_idx.dtype == jnp.int32


def test_switch_aux_loss():
    n_experts, k = 4, 2
    uniform = Routing(
        topk_idx=jnp.array([[[0, 1], [2, 3]]], jnp.int32),
        topk_weights=jnp.full((1, 2, k), 0.5),
        probs=jnp.full((1, 2, n_experts), 1 / n_experts),
    )
    np.testing.assert_allclose(switch_aux_loss(uniform), k, rtol=1e-6)
    # Collapsed routing with confident probabilities: E * (1 * p0 + 1 * p1).
    probs = jnp.array([[[0.6, 0.3, 0.05, 0.05], [0.6, 0.3, 0.05, 0.05], [0.0, 0.0, 0.0, 1.0]]])
    idx = jnp.array([[[0, 1], [0, 1], [3, 2]]], jnp.int32)
    r = Routing(topk_idx=idx, topk_weights=jnp.ones((1, 3, k)), probs=probs)
    valid = jnp.array([[True, True, False]])
    np.testing.assert_allclose(switch_aux_loss(r, valid), n_experts * (0.6 + 0.3), rtol=1e-6)


@pytest.mark.usefixtures("pallas_interpreted_on_cpu")
@pytest.mark.parametrize(
    ("capability", "ran"),
    [
        (10.0, "scaled_matmul"),  # Blackwell: native block-scaled FP4 first
        (9.0, "pallas"),  # Hopper (and the CPU: `test_config` checks the order there)
    ],
)
def test_rollout_moe_runs_the_expert_matmul_the_device_calls_for(monkeypatch, capability, ran):
    """An FP4 rollout's MoE call on packed experts (implementation "pallas"): each of its three
    expert matmuls runs the implementation `fp4_moe_matmul_with_implementation` reports for the
    faked compute capability, with the XLA path's output (float32: to summation order); the
    XLA path never calls the kernel op."""
    qcfg = QuantConfig.nvfp4()
    cfg, layer_moe, x = make_moe()
    monkeypatch.setattr(fp4_moe_matmul_api, "_compute_capability", lambda: capability)
    calls = []

    def reporting_matmul(lhs, rhs, group_sizes, **kw):
        out, name = fp4_moe_matmul_with_implementation(lhs, rhs, group_sizes, **kw)
        calls.append(name)
        return out

    monkeypatch.setattr(moe_module, "fp4_moe_matmul", reporting_matmul)

    def run(implementation):
        pallas = implementation == "pallas"
        packed = {0: pack_experts(layer_moe, qcfg, cfg.dtype)} if pallas else None
        site = QuantSites(
            qcfg, cfg.n_layers, SiteMode.RTN, differentiable=False,
            implementation=implementation, packed_experts=packed,
        )  # fmt: skip
        return layer_moe(x, layer=0, site=site)[0]

    y = run("pallas")
    assert calls == [ran] * 3  # gate, up, down
    y_ref = run("xla")
    assert calls == [ran] * 3
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5 * float(jnp.abs(y_ref).max()))


def _pallas_call_names(jaxpr) -> list[str]:
    """Names of the `pallas_call`s inside `jaxpr` (nested jits, loops and conds included)."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(eqn.params["name"])
            continue
        for param in jax.tree.leaves(eqn.params, is_leaf=lambda p: hasattr(p, "eqns")):
            inner = param.jaxpr if isinstance(param, jax_core.ClosedJaxpr) else param
            if isinstance(inner, jax_core.Jaxpr):
                names += _pallas_call_names(inner)
    return names


@pytest.mark.usefixtures("pallas_interpreted_on_cpu")
@pytest.mark.parametrize(
    ("setting", "by_default", "prefill_decodes_first"),
    [(None, False, False), (None, True, True), (True, False, True), (False, True, False)],
)
def test_predecode_experts_decodes_the_weights_first_in_calls_where_it_pays(
    monkeypatch, setting, by_default, prefill_decodes_first
):
    """`ModelConfig.predecode_experts`: each expert matmul of a call with the rows per expert
    from which it pays (here 2: the B x T x top-k = 20 rows of 8 experts) runs the weights'
    decode pass first where the setting (or, unset, the op's default) says; a decode-step-sized
    call (B x 1 x top-k = 4 rows) never does. Either way the output is the XLA path's to
    float32 summation order."""
    qcfg = QuantConfig.nvfp4()
    cfg, layer_moe, x = make_moe(predecode_experts=setting)
    monkeypatch.setattr(fp4_moe_matmul_api, "PREDECODE_MIN_ROWS_PER_GROUP", 2)
    monkeypatch.setattr(fp4_moe_matmul_api, "PREDECODE_BY_DEFAULT", by_default)

    def site(implementation):
        pallas = implementation == "pallas"
        packed = {0: pack_experts(layer_moe, qcfg, cfg.dtype)} if pallas else None
        return QuantSites(
            qcfg, cfg.n_layers, SiteMode.RTN, differentiable=False,
            implementation=implementation, packed_experts=packed,
        )  # fmt: skip

    def decode_passes(x):
        jaxpr = jax.make_jaxpr(lambda x: layer_moe(x, layer=0, site=site("pallas"))[0])(x)
        return _pallas_call_names(jaxpr.jaxpr).count("fp4_weights_decode")

    assert decode_passes(x) == (3 if prefill_decodes_first else 0)  # gate, up, down
    assert decode_passes(x[:, :1]) == 0
    y, y_ref = (layer_moe(x, layer=0, site=site(impl))[0] for impl in ("pallas", "xla"))
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5 * float(jnp.abs(y_ref).max()))
