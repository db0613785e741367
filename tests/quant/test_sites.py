"""QuantSites and the expert-slot alignment of guidance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.common import Implementation
from trace_jax import fp4
from trace_jax.models import identity_site, site_implementation
from trace_jax.quant import QuantConfig, QuantSites, SiteMode, align_expert_guidance

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


def test_align_expert_guidance_permutes_slots_and_masks_missing_experts():
    x = jax.random.normal(jax.random.key(0), (2, 3, 4, 32))  # [B, T, K, F]
    g = fp4.make_guidance(fp4.quantize(x, "mxfp4"), "full")
    roll = jnp.array([[[0, 1, 2, 3]] * 3] * 2)
    train = jnp.array([[[3, 1, 7, 0]] * 3] * 2)  # expert 7 was not used by the rollout
    a = align_expert_guidance(g, roll, train)
    codes, src = np.asarray(a.rollout_codes()), np.asarray(g.rollout_codes())
    np.testing.assert_array_equal(codes[:, :, 0], src[:, :, 3])
    np.testing.assert_array_equal(codes[:, :, 1], src[:, :, 1])
    np.testing.assert_array_equal(codes[:, :, 3], src[:, :, 0])
    np.testing.assert_array_equal(np.asarray(a.mask)[0, 0], [True, True, False, True])


def test_unmatched_slots_fall_back_to_rtn_and_are_counted():
    qcfg = QuantConfig.nvfp4(guided_layers=(0,))
    h = jax.random.normal(jax.random.key(1), (1, 2, 2, 32))
    roll_experts = jnp.array([[[[0, 1], [2, 3]]]])  # [L, B, T, K]
    train_experts = jnp.array([[[1, 5], [3, 2]]])
    g = fp4.make_guidance(fp4.quantize(h * 1.3, "nvfp4"), "full")
    guidance = {k: g for k in qcfg.guided_keys(1)}
    sites = QuantSites(qcfg, 1, SiteMode.GUIDED, guidance=guidance, rollout_experts=roll_experts)
    y = sites(h, name="expert_mid", layer=0, experts=train_experts)
    cov = sites.coverage["0/expert_mid"]
    assert int(cov["rows"]) == 4 and int(cov["guided_rows"]) == 3
    rtn = fp4.fake_quant(h, "nvfp4")
    np.testing.assert_array_equal(y[0, 0, 1], rtn[0, 0, 1])  # expert 5: no guidance -> RTN
    assert not np.array_equal(y[0, 0, 0], rtn[0, 0, 0])  # guided by the rollout's scales
    with pytest.raises(ValueError, match="expert choices"):
        sites(h, name="expert_mid", layer=0)


def test_modes_and_weights():
    qcfg = QuantConfig.mxfp4_w4a8()
    x = jax.random.normal(jax.random.key(2), (2, 3, 64))
    w = jax.random.normal(jax.random.key(3), (4, 16, 64))
    off = QuantSites(qcfg, 2, SiteMode.OFF)
    np.testing.assert_array_equal(off(x, name="expert_in", layer=0), x)
    rtn = QuantSites(qcfg, 2, SiteMode.RTN, capture=["1/expert_in"])
    np.testing.assert_array_equal(rtn(x, name="expert_in", layer=1), fp4.fake_quant(x, "mxfp8"))
    assert rtn.captured["1/expert_in"].fmt is fp4.MXFP8
    np.testing.assert_array_equal(
        rtn(w, name="w_up", layer=0), fp4.fake_quant(w, "mxfp4", global_axes=(-2, -1))
    )
    assert QuantConfig.bf16().format_for("k") is None
    with pytest.raises(ValueError, match="unknown quantization site"):
        qcfg.format_for("router")
    with pytest.raises(ValueError, match="weights are FP4"):
        QuantConfig(weight_format="mxfp8")
    with pytest.raises(ValueError, match="out of range"):
        QuantConfig(guided_layers=(5,)).layers_guided(4)
    assert QuantConfig().layers_guided(8) == (4, 5, 6, 7)


def test_quads_residual_compensation_reduces_the_activation_error():
    qcfg = QuantConfig.mxfp4_w4a4()
    x = jax.random.t(jax.random.key(4), 3.0, (4, 6, 64))
    plain = QuantSites(qcfg, 2, SiteMode.RTN, differentiable=False)
    comp = QuantSites(qcfg, 2, SiteMode.RTN, differentiable=False, residual_fraction=0.125)
    y0 = plain(x, name="expert_in", layer=0)
    y1 = comp(x, name="expert_in", layer=0)
    e0 = jnp.abs(y0 - x)
    e1 = jnp.abs(y1 - x)
    assert float(jnp.linalg.norm(y1 - x)) < 0.9 * float(jnp.linalg.norm(y0 - x))
    # Only the 8 worst channels per row change, each one's error shrinks or stays.
    changed = np.asarray(y1 != y0)
    assert changed.sum(-1).max() <= 8 and changed.any()
    assert bool(jnp.all(jnp.where(changed, e1 <= e0, True)))
    # KV sites and weights are not compensated.
    np.testing.assert_array_equal(
        comp(x[..., None, :], name="k", layer=0), plain(x[..., None, :], name="k", layer=0)
    )
    with pytest.raises(ValueError, match="rollout feature"):
        QuantSites(qcfg, 2, SiteMode.RTN, residual_fraction=0.1)


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_fused_pallas_capture_gives_the_same_guidance(mode):
    """implementation="pallas" hands over the fused kernel's bits / packed codes; they equal the
    guidance made from the XLA quantizer's codes, and the forward values are identical."""
    qcfg = QuantConfig.nvfp4()
    x = jax.random.normal(jax.random.key(5), (3, 64))
    keys = ["1/expert_in", "1/k"]
    out = {}
    for implementation in ("xla", "pallas"):
        sites = QuantSites(
            qcfg, 2, SiteMode.RTN, capture=keys, differentiable=False, implementation=implementation
        )
        assert sites.implementation == implementation
        ys = [sites(x, name=key.split("/")[1], layer=1) for key in keys]
        out[implementation] = (ys, sites.captured_guidance(mode))
    assert set(out["pallas"][1]) == set(keys)
    for u, v in zip(jax.tree.leaves(out["xla"]), jax.tree.leaves(out["pallas"]), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_quantized_returns_the_sites_qtensor_and_packed_experts_need_pallas():
    qcfg = QuantConfig.nvfp4()
    x = jax.random.normal(jax.random.key(6), (2, 3, 64))
    sites = QuantSites(qcfg, 2, SiteMode.RTN, differentiable=False)
    y, q = sites.quantized(x, name="expert_in", layer=0)
    ref = fp4.quantize(x, "nvfp4")
    for u, v in zip(jax.tree.leaves(q), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    np.testing.assert_array_equal(y, sites(x, name="expert_in", layer=0))
    assert QuantSites(qcfg, 2, SiteMode.OFF).quantized(x, name="expert_in", layer=0)[1] is None
    assert sites.packed_experts_for(0) is None
    with pytest.raises(ValueError, match="packed_experts feed the Pallas"):
        QuantSites(qcfg, 2, SiteMode.RTN, differentiable=False, packed_experts={0: object()})


def test_implementation_is_checked_and_the_trainer_stays_on_xla():
    qcfg = QuantConfig.nvfp4()
    assert QuantSites(qcfg, 2, SiteMode.RTN).implementation is Implementation.XLA
    assert site_implementation(QuantSites(qcfg, 2, SiteMode.RTN)) is Implementation.XLA
    assert site_implementation(identity_site) is Implementation.XLA
    with pytest.raises(ValueError, match="implementation must be 'xla' or 'pallas', got 'cuda'"):
        QuantSites(qcfg, 2, SiteMode.RTN, differentiable=False, implementation="cuda")
    with pytest.raises(ValueError, match="differentiable=False"):  # the trainer's sites
        QuantSites(qcfg, 2, SiteMode.RTN, implementation="pallas")
