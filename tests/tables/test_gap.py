"""The train-rollout gap measured end to end on a minimal problem, and its metrics."""

from __future__ import annotations

import numpy as np
import pytest

from configs import train_rollout_gap
from tests import tiny
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables.gap import GapConfig, gap_metrics, measure_gap


# The layer study's tests score the same shapes (2 rows of up to 16 prompt tokens, 4 new tokens,
# 2 blocks): in one worker they share the compiled rollouts and forwards.
@pytest.mark.xdist_group("gap_shapes")
def test_every_mode_on_a_minimal_problem():
    cd = train_rollout_gap.get_config()
    cd.model.n_layers = tiny.N_LAYERS
    cd.rl.max_new_tokens = 4
    result = measure_gap(ExperimentConfig.from_config_dict(cd), GapConfig(batch=2, prompt_len=16))
    assert [r["mode"] for r in result.rows] == ["off (bf16 pair)"] + [
        m for m in ("rtn", "guided full", "guided compact") for _ in (0, 1)
    ]
    assert [r["replay"] for r in result.rows[1:3]] == [False, True]
    by = {(r["mode"], r["replay"]): r for r in result.rows}
    # The guided trainer follows the rollout's codes; compact guidance loses nothing of full.
    assert by["guided full", True]["code_mismatch"] <= by["rtn", True]["code_mismatch"]
    assert by["guided full", True]["code_mismatch"] == by["guided compact", True]["code_mismatch"]
    assert (
        0
        < by["guided compact", True]["guidance_bytes_per_token"]
        < by["guided full", True]["guidance_bytes_per_token"]
    )
    assert by["rtn", False]["guidance_bytes_per_token"] == 0.0
    assert result.guided_layers == (1,)  # the deeper half of 2 layers
    assert {(s["layer"], s["site"]) for s in result.per_site} >= {(0, "k"), (1, "expert_in")}
    assert "random init (std 0.08)" in result.policy


def test_gap_metrics_against_numpy():
    lp_train = np.array([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    lp_roll = np.array([[-1.5, -2.0, -9.0], [-0.2, -2.0, 0.0]])
    mask = np.array([[True, True, False], [True, True, False]])
    got = gap_metrics(lp_train, lp_roll, mask)
    d = np.array([0.5, 0.0, 0.1, -1.0])
    assert got["logp_gap_mean"] == pytest.approx(np.abs(d).mean())
    assert got["logp_gap_max"] == pytest.approx(1.0)
    assert got["kl"] == pytest.approx(np.mean(np.exp(d) - 1 - d))
