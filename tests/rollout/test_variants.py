"""The benchmark model's init: with selective attention its routers spread a random prompt's tokens
near-uniformly over the experts, where the plain init's collapse onto a few."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.models import ModelConfig
from trace_jax.rollout.variants import (
    SELECTIVE_QK_NORM_SCALE,
    rollout_inputs,
    rollout_policy,
)

# Three blocks (not tests/tiny.py's two): the plain init's collapse compounds over the blocks and
# is clear from the third on. Wider than `tiny` (D=128, 32 experts, top 4) and a vocabulary of
# 4096, so that a 256-token prompt repeats few tokens.
CFG = ModelConfig.tiny(n_layers=3, d_model=128, vocab_size=4096, n_experts=32, top_k=4)
BATCH, PROMPT_LEN = 2, 256


def busiest_over_mean(init: str) -> np.ndarray:
    """[L, B]: per layer and prompt of `rollout_inputs`' random prompts, the busiest expert's
    rows (tokens x top-k) over the mean, counted from the forward's top-k with numpy."""
    cfg, graphdef, params = rollout_policy(CFG, init=init)
    _, prompts, _, _ = rollout_inputs(cfg, params, BATCH, PROMPT_LEN)
    _, aux = nnx.merge(graphdef, params)(prompts)
    topk = np.asarray(aux["topk_idx"])  # [L, B, T, K]
    counts = np.stack(
        [[np.bincount(t.ravel(), minlength=cfg.n_experts) for t in layer] for layer in topk]
    )
    return counts.max(-1) / (PROMPT_LEN * cfg.top_k / cfg.n_experts)


def uniform_busiest_over_mean(seed: int = 0, trials: int = 50) -> float:
    """The same for routing by K distinct experts drawn uniformly per token (mean of trials)."""
    rng = np.random.default_rng(seed)
    e, k = CFG.n_experts, CFG.top_k
    picks = [np.argsort(rng.random((PROMPT_LEN, e)), axis=1)[:, :k] for _ in range(trials)]
    return float(np.mean([np.bincount(p.ravel(), minlength=e).max() for p in picks]) * e) / (
        PROMPT_LEN * k
    )


def test_selective_attention_routes_near_uniformly_where_the_plain_init_collapses():
    uniform = uniform_busiest_over_mean()  # about 1.37
    plain = busiest_over_mean("normal")
    selective = busiest_over_mean("selective_attention")
    # plain: every prompt's last block sends its busiest expert three times the mean or more
    assert plain[-1].min() > 2.2 * uniform, plain
    # selective: every block of every prompt within 1.5x of uniform routing's busiest expert
    assert selective.max() < 1.5 * uniform, selective


def test_rollout_policy_sets_only_the_attention_norms():
    _, _, plain = rollout_policy(CFG, init="normal")
    _, _, selective = rollout_policy(CFG, init="selective_attention")
    flat_plain, flat_selective = (dict(nnx.to_flat_state(s)) for s in (plain, selective))
    assert flat_plain.keys() == flat_selective.keys()
    assert sum(p[-2:] == ("q_norm", "scale") for p in flat_selective) == CFG.n_layers
    for path, value in flat_selective.items():
        got, base = (
            np.asarray(value[...], np.float32),
            np.asarray(flat_plain[path][...], np.float32),
        )
        if path[-2:] in (("q_norm", "scale"), ("k_norm", "scale")):
            assert value[...].dtype == jnp.bfloat16
            np.testing.assert_array_equal(got, np.full_like(base, SELECTIVE_QK_NORM_SCALE))
            np.testing.assert_array_equal(base, np.ones_like(base))
        else:
            np.testing.assert_array_equal(got, base, err_msg=str(path))


def test_rollout_policy_refuses_an_unknown_init():
    with pytest.raises(ValueError, match="unknown model init"):
        rollout_policy(CFG, init="trained")
