"""`ModelConfig.remat`: every block of a training forward is checkpointed, the gradients are those
of the plain forward, and a stateful site's records (guided coverage, mismatch statistics) leave
the checkpoints intact."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from tests.rl.rollouts import task_rollout
from trace_jax.fp4 import GuidanceMode
from trace_jax.models import ModelConfig, init_model
from trace_jax.quant import QuantSites, SiteMode
from trace_jax.rl.config import GRPOConfig
from trace_jax.rl.methods import get_method
from trace_jax.rl.step import trainer_logprobs

CFG = tiny.model_config(dtype=jnp.float32)
GRPO = GRPOConfig(group_size=2)


def _models():
    """(plain, checkpointed) models with the same parameters."""
    return init_model(CFG, seed=3), init_model(dataclasses.replace(CFG, remat=True), seed=3)


def _checkpoints(jaxpr) -> int:
    """How many checkpoint (remat) equations `jaxpr` holds at any depth."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in ("checkpoint", "remat", "remat2")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _checkpoints(sub)
    return n


def _reference_rollout(model, setup):
    """A 2 x 2-sample rollout recording full codes at every quantized site (the trainer's
    mismatch reference), with the method's own guidance derived from them."""
    roll = task_rollout(
        model,
        setup,
        n_problems=2,
        group_size=2,
        capture=setup.rollout_qcfg.all_keys(CFG.n_layers),
        capture_mode=GuidanceMode.FULL,
        seed=5,
    )
    own = {k: roll.guidance[k].as_compact() for k in setup.capture}
    return dataclasses.replace(roll, guidance=own), roll.guidance


def test_remat_is_a_bool():
    with pytest.raises(ValueError, match="remat must be a bool"):
        ModelConfig.tiny(remat=1)


def test_every_block_is_checkpointed_with_the_same_gradients():
    """An NVFP4 fake-quantized forward (FP4 QAT's trainer) on random tokens: one checkpoint per
    block with remat and none without; the loss and every gradient, each jitted as a trainer's
    (one compile, not one per eager operation), agree (float32 compute: the same operations,
    recomputed)."""
    qcfg = get_method("fp4_qat").setup("nvfp4", CFG.n_layers).trainer_qcfg
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, CFG.vocab_size)

    def loss(params, graphdef):
        site = QuantSites(qcfg, CFG.n_layers, SiteMode.RTN)
        logits, _ = nnx.merge(graphdef, params)(tokens, site=site)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0])

    results = []
    for model in _models():
        graphdef, params = nnx.split(model)
        fn = functools.partial(loss, graphdef=graphdef)
        n_checkpoints = _checkpoints(jax.make_jaxpr(fn)(params).jaxpr)
        results.append((n_checkpoints, jax.jit(jax.value_and_grad(fn))(params)))
    (n_plain, (l0, g0)), (n_remat, (l1, g1)) = results
    assert (n_plain, n_remat) == (0, CFG.n_layers)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_guided_records_leave_the_checkpoints():
    """TRACE's guided trainer under remat: the coverage of every guided site and the code
    mismatch against the rollout's full codes are those of the plain forward (entries written
    inside a checkpoint would be its leaked tracers)."""
    setup = get_method("trace").setup("nvfp4", CFG.n_layers)
    plain, checkpointed = _models()
    roll, reference = _reference_rollout(plain, setup)
    outs = [
        jax.jit(
            lambda m: trainer_logprobs(
                m, roll, setup=setup, grpo=GRPO, temperature=1.0, reference=reference
            )
        )(model)
        for model in (plain, checkpointed)
    ]
    assert (
        set(outs[1].coverage)
        == set(outs[0].coverage)
        == set(setup.trainer_qcfg.guided_keys(CFG.n_layers))
    )
    assert set(outs[1].stats) == set(outs[0].stats) == set(reference)
    for got, want in ((outs[1].coverage, outs[0].coverage), (outs[1].stats, outs[0].stats)):
        for key in want:
            for name in want[key]:
                np.testing.assert_allclose(
                    np.asarray(got[key][name]), np.asarray(want[key][name]), rtol=1e-6
                )
    rows = sum(int(c["rows"]) for c in outs[1].coverage.values())
    assert rows > 0 and rows == sum(int(c["guided_rows"]) for c in outs[1].coverage.values())
