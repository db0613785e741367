"""Training forward against the rollout: replay, guided code agreement, alignment, gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from trace_jax import fp4
from trace_jax.fp4 import Guidance
from trace_jax.models import init_model
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rollout import SamplingConfig, generate
from trace_jax.tables.gap import router_agreement as numpy_agreement
from trace_jax.train import train_forward
from trace_jax.train.forward import router_agreement

CFG = tiny.model_config(init_std=0.08)  # bf16 compute, as the real stacks
QCFG = QuantConfig.nvfp4()  # the deeper half of the layers guided
ALL_GUIDED = QuantConfig.nvfp4(guided_layers=tuple(range(CFG.n_layers)))
# Jitted like a real trainer. (Run eagerly, every bf16 op rounds its output and the trainer's
# values drift far from the jitted rollout's: 20-40% code mismatch in the last layer.)
train_forward_jit = nnx.jit(train_forward, static_argnames=("qcfg", "mode", "replay"))
# One worker runs the module: its tests share the rollout fixtures and the compiled forwards.
pytestmark = pytest.mark.xdist_group("train_forward")


@pytest.fixture(scope="module")
def setup():
    model = init_model(CFG, seed=2)
    gd, params = nnx.split(model)
    key = jax.random.key(4)
    prompts = jax.random.randint(key, (6, 10), 1, CFG.vocab_size, jnp.int32)
    lengths = jnp.array([10, 7, 5, 9, 10, 6], jnp.int32)
    roll = generate(
        gd,
        params,
        prompts,
        lengths,
        jax.random.key(5),
        sampling=SamplingConfig(max_new_tokens=16, temperature=1.0),
        qcfg=QCFG,
        mode=SiteMode.RTN,
        capture=QCFG.all_keys(CFG.n_layers),
        capture_mode=fp4.GuidanceMode.FULL,
    )
    return model, roll


@pytest.fixture(scope="module")
def drifted(setup):
    """The rollout's model with its embedding moved by 0.3% (random per element): a trainer a
    small step from the policy that sampled. Without guidance about a quarter of its FP4 codes
    differ from the rollout's (block scales flip). Undrifted, the jitted trainer reproduces the
    rollout's codes exactly on a CPU and to the platform's rounding elsewhere, so the agreement
    tests would measure the platform; the drift makes what guidance undoes the same everywhere."""
    model, _ = setup
    model = nnx.clone(model)
    noise = jax.random.normal(jax.random.key(9), model.embed[...].shape)
    model.embed[...] = model.embed[...] * (1 + 3e-3 * noise)
    return model


def _agreement(out, keys):
    n = sum(int(out.stats[k]["n_elements"]) for k in keys)
    mis = sum(int(out.stats[k]["n_mismatch"]) for k in keys)
    return 1 - mis / n, n


def test_replay_reproduces_expert_choices(setup):
    model, roll = setup
    # The computation of the RTN trainer in the next test (with the rollout's codes as the
    # reference): compiled once for both.
    out = train_forward_jit(
        model, roll, qcfg=QCFG, mode=SiteMode.RTN, replay=True, reference=roll.guidance
    )
    proc = np.asarray(roll.processed)
    np.testing.assert_array_equal(
        np.asarray(out.expert_choices)[:, proc], np.asarray(roll.expert_choices)[:, proc]
    )


def test_guided_full_with_replay_reproduces_rollout_codes(setup, drifted):
    """A drifted trainer, guided at every layer, reproduces the rollout's codes (full or compact
    guidance); a layer left unguided keeps its RTN codes."""
    _, roll = setup
    keys = ALL_GUIDED.guided_keys(CFG.n_layers)
    full = {k: roll.guidance[k] for k in keys}
    compact = {k: fp4.to_compact(g) for k, g in full.items()}
    kw = dict(replay=True, reference=roll.guidance)
    rtn = train_forward_jit(drifted, roll, qcfg=QCFG, mode=SiteMode.RTN, **kw)
    g_full = train_forward_jit(
        drifted, roll, qcfg=ALL_GUIDED, mode=SiteMode.GUIDED, guidance=full, **kw
    )
    g_compact = train_forward_jit(
        drifted, roll, qcfg=ALL_GUIDED, mode=SiteMode.GUIDED, guidance=compact, **kw
    )
    a_rtn, n = _agreement(rtn, keys)
    a_full, _ = _agreement(g_full, keys)
    a_compact, _ = _agreement(g_compact, keys)
    assert n > 10_000
    assert a_rtn < 0.9, a_rtn  # the drift matters (measured: 0.74)
    assert a_full >= 0.999, a_full  # (measured: 1.0)
    assert a_compact >= 0.99 * a_full, (a_compact, a_full)
    assert 1 - a_full <= 0.1 * (1 - a_rtn), (a_full, a_rtn)  # guidance removes >= 90%
    # Every guided row had guidance (replay: the same experts), nothing fell back.
    for c in g_full.coverage.values():
        assert int(c["rows"]) == int(c["guided_rows"]) > 0

    # Unguided layers are untouched by guidance: same codes as RTN there (the same computation
    # in both programs, upstream of every guided site).
    guided = QCFG.guided_keys(CFG.n_layers)
    half = train_forward_jit(
        drifted, roll, qcfg=QCFG, mode=SiteMode.GUIDED, guidance={k: full[k] for k in guided}, **kw
    )
    for k in set(QCFG.all_keys(CFG.n_layers)) - set(guided):
        assert int(rtn.stats[k]["n_mismatch"]) > 0, k
        assert int(half.stats[k]["n_mismatch"]) == int(rtn.stats[k]["n_mismatch"]), k


def test_guidance_alignment_is_slot_exact(setup, drifted):
    """Shifting the guidance by one slot destroys the agreement: it is aligned element-wise."""
    _, roll = setup
    key = f"{CFG.n_layers - 1}/expert_in"
    g = roll.guidance[key]
    shifted = Guidance(
        jnp.roll(g.payload, 1, axis=1),
        jnp.roll(g.scales, 1, axis=1),
        jnp.roll(g.global_scale, 1, axis=1),
        None,
        g.fmt,
        g.mode,
    )
    guidance = {k: roll.guidance[k] for k in ALL_GUIDED.guided_keys(CFG.n_layers)}
    ok = train_forward_jit(
        drifted,
        roll,
        qcfg=ALL_GUIDED,
        mode=SiteMode.GUIDED,
        replay=True,
        guidance=guidance,
        reference=roll.guidance,
    )
    bad = train_forward_jit(
        drifted,
        roll,
        qcfg=ALL_GUIDED,
        mode=SiteMode.GUIDED,
        replay=True,
        guidance={**guidance, key: shifted},
        reference=roll.guidance,
    )
    assert float(ok.stats[key]["mismatch"]) < 1e-3
    assert float(bad.stats[key]["mismatch"]) > 0.2
    # The last processed slot of each row is the one before its final token.
    proc = np.asarray(roll.processed)
    for b in range(proc.shape[0]):
        s = int(roll.lengths[b]) - 2
        assert proc[b, s] and not proc[b, s + 1]


def test_gradient_through_guided_forward(setup):
    model, roll = setup
    guidance = {k: fp4.to_compact(roll.guidance[k]) for k in QCFG.guided_keys(CFG.n_layers)}

    def loss(model):
        out = train_forward(
            model, roll, qcfg=QCFG, mode=SiteMode.GUIDED, replay=True, guidance=guidance
        )
        return -jnp.sum(out.logprobs) + out.router_aux_loss

    grads = nnx.jit(nnx.grad(loss))(model)
    leaves = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(grads)}
    for name in ("w_gate", "w_down", "w_k"):
        g = [v for p, v in leaves.items() if name in p]
        assert g and all(bool(jnp.all(jnp.isfinite(x))) for x in g)
        assert max(float(jnp.abs(x).max()) for x in g) > 0, name


def test_missing_guidance_is_an_error(setup):
    model, roll = setup
    with pytest.raises(ValueError, match="no rollout guidance for sites"):
        train_forward(model, roll, qcfg=QCFG, mode=SiteMode.GUIDED, guidance={})


def test_router_agreement_against_numpy():
    """The trainer router's own top-k vs the rollout's experts, on processed tokens only."""

    rng = np.random.default_rng(0)
    probs = rng.random((3, 4, 6, 8)).astype(np.float32)  # [L, B, T, E]
    own = np.argsort(-probs, axis=-1)[..., :2]  # the trainer's top-2
    rollout = own.copy()
    flip = rng.random(rollout.shape[:-1]) < 0.4  # some tokens: the rollout's 2nd expert differs
    rollout[..., 1] = np.where(flip, np.argsort(-probs, axis=-1)[..., 5], rollout[..., 1])
    processed = rng.random((4, 6)) < 0.7
    got = float(router_agreement(jnp.asarray(probs), jnp.asarray(rollout), jnp.asarray(processed)))
    np.testing.assert_allclose(got, numpy_agreement(own, rollout, processed), rtol=1e-6)
    assert 0.5 < got < 1.0
    same = float(router_agreement(jnp.asarray(probs), jnp.asarray(own), jnp.asarray(processed)))
    assert same == 1.0
