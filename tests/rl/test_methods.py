"""The methods registry: QuantConfigs per recipe, guidance capture, and every loss end to end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.fp4 import GuidanceMode
from trace_jax.quant import QUANT_RECIPES, QuantConfig, SiteMode, quant_recipe
from trace_jax.rl import METHODS, GRPOConfig, Method, bind_loss, get_method

N_LAYERS = 4
FORMATS = ("nvfp4", "mxfp4_w4a4", "mxfp4_w4a8")


def test_registry_has_exactly_the_compared_methods():
    assert set(METHODS) == {"bf16", "fp4_qat", "qarl", "quads", "trace", "trace_full"}
    assert set(QUANT_RECIPES) == set(FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_setup(name, fmt):
    s = get_method(name).setup(fmt, N_LAYERS)
    preset = quant_recipe(fmt)
    ro, tr = s.rollout_qcfg, s.trainer_qcfg
    if name == "bf16":
        assert ro == tr == QuantConfig.bf16()
        assert s.rollout_mode is s.trainer_mode is SiteMode.OFF
        assert s.capture == ()
        return
    assert s.rollout_mode is SiteMode.RTN
    fields = ("weight_format", "activation_format", "kv_format")
    assert [getattr(ro, f) for f in fields] == [getattr(preset, f) for f in fields]
    if name == "quads":
        assert tr.weight_format == preset.weight_format
        assert tr.activation_format is None and tr.kv_format is None
        assert s.rollout_residual_channels > 0
    else:
        assert [getattr(tr, f) for f in fields] == [getattr(preset, f) for f in fields]
        assert s.rollout_residual_channels == 0
    assert s.loss == ("tbpo" if name == "qarl" else "ppo_clip")
    if name.startswith("trace"):
        assert s.trainer_mode is SiteMode.GUIDED
        layers = (2, 3) if name == "trace" else (0, 1, 2, 3)
        mode = GuidanceMode.COMPACT if name == "trace" else GuidanceMode.FULL
        assert ro.layers_guided(N_LAYERS) == tr.layers_guided(N_LAYERS) == layers
        assert s.capture_mode is mode and tr.guidance_mode is mode
        assert s.capture == tr.guided_keys(N_LAYERS)
        assert {k.split("/")[0] for k in s.capture} == {str(i) for i in layers}
        assert {k.split("/")[1] for k in s.capture} == {"expert_in", "expert_mid", "k", "v"}
    else:
        assert s.trainer_mode is SiteMode.RTN
        assert s.capture == ()


def test_guided_layers_override():
    trace = get_method("trace")
    assert trace.guided_layers == "half" and get_method("trace_full").guided_layers == "all"
    s = trace.setup("nvfp4", 40, guided_layers=(39, 35, 36, 37, 38))
    assert s.trainer_qcfg.layers_guided(40) == (35, 36, 37, 38, 39)
    assert s.rollout_qcfg.guided_layers == (35, 36, 37, 38, 39)  # resolved, sorted
    s = trace.setup("nvfp4", 40, guided_layers="eighth")
    assert s.rollout_qcfg.layers_guided(40) == (35, 36, 37, 38, 39)
    assert {int(k.split("/")[0]) for k in s.capture} == {35, 36, 37, 38, 39}
    # the default and an override naming the same layers give equal configs
    default = trace.quant_configs("nvfp4", 8)
    assert default == trace.quant_configs("nvfp4", 8, guided_layers="4,5,6,7")
    assert trace.setup("nvfp4", 5).rollout_qcfg.guided_layers == (2, 3, 4)
    with pytest.raises(ValueError, match="out of range"):
        trace.setup("nvfp4", 4, guided_layers=(4,))
    with pytest.raises(ValueError, match="out of range"):
        trace.setup("nvfp4", 4, guided_layers="0,4")
    with pytest.raises(ValueError, match="comma list"):
        trace.setup("nvfp4", 4, guided_layers="deep")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_loss_runs_with_finite_grads(name):
    cfg = GRPOConfig(beta=0.05, loss_aggregation="seq_mean")
    loss_fn = get_method(name).loss_fn(cfg)
    ks = jax.random.split(jax.random.key(7), 6)
    b, s = 6, 10
    mask = jax.random.bernoulli(ks[0], 0.6, (b, s)).at[:, 0].set(False).at[:, 1].set(True)
    roll = -jax.random.exponential(ks[1], (b, s))
    old = roll + 0.2 * jax.random.normal(ks[2], (b, s))
    new = old + 0.3 * jax.random.normal(ks[3], (b, s))
    ref = old + 0.1 * jax.random.normal(ks[4], (b, s))
    adv = jax.random.normal(ks[5], (b,))

    @jax.jit
    def step(x):
        return jax.value_and_grad(
            lambda v: loss_fn(
                v, logp_old=old, logp_rollout=roll, advantages=adv, mask=mask, logp_ref=ref
            ),
            has_aux=True,
        )(x)

    (loss, metrics), g = step(new)
    assert np.isfinite(float(loss))
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert bool(jnp.all(jnp.isfinite(g)))
    assert float(jnp.max(jnp.abs(g))) > 0
    np.testing.assert_array_equal(np.asarray(g)[~np.asarray(mask)], 0.0)


def test_bad_names_and_methods_raise():
    with pytest.raises(ValueError, match=r"unknown method 'trace_compact'.*'bf16'.*'trace_full'"):
        get_method("trace_compact")
    with pytest.raises(ValueError, match="unknown FP4 recipe 'fp8'"):
        get_method("trace").setup("fp8", N_LAYERS)
    with pytest.raises(ValueError, match="unknown FP4 recipe"):
        get_method("bf16").setup("nvfp4_w4a4", N_LAYERS)
    with pytest.raises(ValueError, match="unknown loss"):
        bind_loss("grpo", GRPOConfig())
    common = dict(name="x", description="", rollout_mode="rtn")
    with pytest.raises(ValueError, match="needs rollout guidance"):
        Method(**common, trainer_mode="guided", loss="ppo_clip")
    with pytest.raises(ValueError, match="unknown loss"):
        Method(**common, trainer_mode="rtn", loss="dpo")
    with pytest.raises(ValueError, match="not QuantConfig fields"):
        Method(**common, trainer_mode="rtn", loss="ppo_clip", trainer_overrides=(("w", None),))
    with pytest.raises(ValueError, match="not GUIDED"):
        Method(name="x", description="", rollout_mode="guided", trainer_mode="rtn", loss="tbpo")
    with pytest.raises(ValueError, match="x: guided layers must be one of"):
        Method(**common, trainer_mode="rtn", loss="ppo_clip", guided_layers="deepest")
