"""Aggregation from run logs written by hand: log statistics, adaptation, shared runs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tables import support
from trace_jax.tables import aggregate as agg
from trace_jax.tables.grid import Table


def _table(**rl):
    cd = support.table_config()
    cd.rl.update(rl)
    return Table.from_config_dict(cd)


def test_run_statistics_average_logged_steps_then_seeds():
    seed0 = [
        {"step": 0, "train_rollout_gap_mean": 0.1, "code_mismatch": 0.2, "one_apart_fraction": 1.0},
        {"step": 1, "train_rollout_gap_mean": 0.3},
    ]
    seed1 = [{"step": 0, "train_rollout_gap_mean": 0.5, "code_mismatch": 0.4}]
    got = agg.run_statistics([seed0, seed1])
    assert got == pytest.approx(
        {"train_rollout_gap_mean": (0.2 + 0.5) / 2, "code_mismatch": 0.3, "one_apart_fraction": 1.0}
    )
    assert "train_rollout_kl_k3" not in got  # never logged: no number
    assert agg.run_statistics([[{"step": 0, "reward": 1.0}]]) == {}


def test_adaptation_finds_the_first_match_on_the_hardest_split(tmp_path):
    """Hardest split: the SFT policy's lowest; "match": run mean >= reference mean - its std."""
    cd = support.table_config()
    cd.eval.splits = ("level1", "aime24", "aime25")
    table = Table.from_config_dict(cd)
    # aime25 is the hardest for the SFT policy; aime24 would be for the reference's last eval.
    support.write_sft_eval(tmp_path, {"bf16": {"level1": 0.1, "aime24": 0.4, "aime25": 0.2}})
    ref = {0: [0.30, 0.40, 0.50], 1: [0.34, 0.44, 0.54]}  # per seed, steps 0..2
    run = {0: [0.20, 0.40, 0.60], 1: [0.24, 0.42, 0.50]}
    for label, vals in (("bf16", ref), ("trace", run)):
        for seed, series in vals.items():
            evals = [{"step": i, "aime24": 0.0, "aime25": v} for i, v in enumerate(series)]
            support.write_run_logs(tmp_path, label, seed, evals)
    got = agg.adaptation(table, str(tmp_path))  # trace against bf16 by default
    assert got["split"] == "aime25"
    # step 0: 0.22 < 0.32 - 0.028; step 1: 0.41 >= 0.42 - 0.028 -> matched at step 1.
    assert [p["step"] for p in got["points"]] == [0, 1, 2] and got["matched_at"] == 1
    np.testing.assert_allclose(got["points"][1]["ref_std"], np.std([0.40, 0.44], ddof=1))
    np.testing.assert_allclose(got["points"][1]["trace"], 0.41)
    assert agg.adaptation(table, str(tmp_path), run="qarl", reference="bf16") is None
    # Never within reach: no step.
    for seed in (0, 1):
        evals = [{"step": i, "aime24": 0.0, "aime25": 0.0} for i in range(3)]
        support.write_run_logs(tmp_path, "trace", seed, evals)
    assert agg.adaptation(table, str(tmp_path))["matched_at"] is None


def test_shared_runs_name_the_run_each_copy_came_from(tmp_path):
    table = _table()
    for label in table.labels:
        for seed in table.seeds:
            support.write_run_logs(tmp_path, label, seed, [{"step": 2}])
    (tmp_path / "trace" / "seed1" / "same_run_as.txt").write_text("table7_policies/trace/seed1\n")
    assert agg.shared_runs(table, str(tmp_path)) == [("trace", 1, "table7_policies/trace/seed1")]
