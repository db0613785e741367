"""Aggregation from run logs written by hand: log statistics, adaptation, shared runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.tables import support
from trace_jax.tables import aggregate as agg
from trace_jax.tables.grid import Table, benchmark_average


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
    # Per response: each step's per-token KL times its mean response length (steps without a
    # length give none), averaged over steps, then seeds.
    seed0 = [
        {"step": 0, "train_rollout_kl_k3": 0.01, "response_length": 100.0},
        {"step": 1, "train_rollout_kl_k3": 0.03, "response_length": 300.0},
        {"step": 2, "train_rollout_kl_k3": 0.5},
    ]
    seed1 = [{"step": 0, "train_rollout_kl_k3": 0.002, "response_length": 500.0}]
    got = agg.run_statistics([seed0, seed1])
    assert got["train_rollout_kl_per_response"] == pytest.approx(((1.0 + 9.0) / 2 + 1.0) / 2)
    assert got["train_rollout_kl_k3"] == pytest.approx((0.18 + 0.002) / 2)


def test_adaptation_finds_the_first_match_on_the_hardest_split(tmp_path):
    """Hardest split: the SFT policy's lowest; "match": run mean >= reference mean - its std."""
    cd = support.table_config()
    cd.eval.splits = ("level1", "arith_countdown_l2", "arith_countdown_l3")
    table = Table.from_config_dict(cd)
    # _l3 is the hardest for the SFT policy; _l2 would be for the reference's last evaluation.
    support.write_sft_eval(
        tmp_path, {"bf16": {"level1": 0.1, "arith_countdown_l2": 0.4, "arith_countdown_l3": 0.2}}
    )
    ref = {0: [0.30, 0.40, 0.50], 1: [0.34, 0.44, 0.54]}  # per seed, steps 0..2
    run = {0: [0.20, 0.40, 0.60], 1: [0.24, 0.42, 0.50]}
    for label, vals in (("bf16", ref), ("trace", run)):
        for seed, series in vals.items():
            evals = [
                {"step": i, "arith_countdown_l2": 0.0, "arith_countdown_l3": v}
                for i, v in enumerate(series)
            ]
            support.write_run_logs(tmp_path, label, seed, evals)
    got = agg.adaptation(table, str(tmp_path))  # trace against bf16 by default
    assert got["split"] == "arith_countdown_l3"
    # step 0: 0.22 < 0.32 - 0.028; step 1: 0.41 >= 0.42 - 0.028 -> matched at step 1.
    assert [p["step"] for p in got["points"]] == [0, 1, 2] and got["matched_at"] == 1
    np.testing.assert_allclose(got["points"][1]["ref_std"], np.std([0.40, 0.44], ddof=1))
    np.testing.assert_allclose(got["points"][1]["trace"], 0.41)
    assert agg.adaptation(table, str(tmp_path), run="qarl", reference="bf16") is None
    # Never within reach: no step.
    for seed in (0, 1):
        evals = [
            {"step": i, "arith_countdown_l2": 0.0, "arith_countdown_l3": 0.0} for i in range(3)
        ]
        support.write_run_logs(tmp_path, "trace", seed, evals)
    assert agg.adaptation(table, str(tmp_path))["matched_at"] is None


def test_shared_runs_name_the_run_each_copy_came_from(tmp_path):
    table = _table()
    for label in table.labels:
        for seed in table.seeds:
            support.write_run_logs(tmp_path, label, seed, [{"step": 2}])
    (tmp_path / "trace" / "seed1" / "same_run_as.txt").write_text("table7_policies/trace/seed1\n")
    assert agg.shared_runs(table, str(tmp_path)) == [("trace", 1, "table7_policies/trace/seed1")]


def test_logs_under_older_split_names_aggregate_under_the_current_ones(tmp_path):
    """Logs that use the older split names (`aime24` for `arith_countdown_l2`) give the table of
    the same logs under the current names."""
    table = _table()  # splits level1, arith_countdown_l2; 3 steps, seeds 0 and 1
    for name in ("aime24", "arith_countdown_l2"):
        for i, label in enumerate(table.labels):
            for seed in table.seeds:
                evals = [{"step": s, "level1": 0.5, name: 0.1 * (s + seed + i)} for s in range(3)]
                support.write_run_logs(tmp_path / name, label, seed, evals)
        support.write_sft_eval(tmp_path / name, {"bf16": {"level1": 0.4, name: 0.05}})
    old, new = str(tmp_path / "aime24"), str(tmp_path / "arith_countdown_l2")
    rows = agg.aggregate(table, old)
    assert rows == agg.aggregate(table, new)
    assert not any("aime24" in key for row in rows for key in row)
    trace = rows[1]  # final step 2: 0.1 * (2 + seed + 1) for seeds 0, 1
    assert trace["arith_countdown_l2"] == pytest.approx(0.35)
    assert trace["arith_countdown_l2_std"] == pytest.approx(np.std([0.3, 0.4], ddof=1))
    assert trace["average"] == pytest.approx(0.35)
    assert agg.sft_row(table, old) == agg.sft_row(table, new)
    assert agg.sft_row(table, old)["arith_countdown_l2"] == 0.05
    assert agg.adaptation(table, old) == agg.adaptation(table, new)
    assert agg.adaptation(table, old)["split"] == "arith_countdown_l2"
    assert agg.curves(table, old) == agg.curves(table, new)


def test_each_run_starts_from_the_sft_score_under_its_own_execution(tmp_path):
    """bf16 rollouts start from the bf16 evaluation of the SFT policy, FP4 ones from the FP4
    evaluation of their format; a format the SFT stage did not evaluate has no start."""
    table = _table(format="nvfp4")
    assert agg.run_execution(table, "bf16") == "bf16"
    assert agg.run_execution(table, "trace") == "nvfp4"
    support.write_sft_eval(
        tmp_path,
        {
            "bf16": {"level1": 0.3, "arith_countdown_l2": 0.2},
            "nvfp4": {"level1": 0.1, "arith_countdown_l2": 0.4},
        },
    )
    assert agg.start_row(table, str(tmp_path), "bf16")["level1"] == 0.3
    assert agg.start_row(table, str(tmp_path), "trace")["level1"] == 0.1
    assert agg.start_row(table, str(tmp_path), "trace")["run"] == "SFT start (nvfp4)"
    mx = _table(format="mxfp4_w4a4")
    assert agg.run_execution(mx, "trace") == "mxfp4_w4a4"
    assert agg.start_row(mx, str(tmp_path), "trace") is None


def test_seeds_from_two_sft_stages_start_from_their_mean(tmp_path):
    """Runs record the SFT stage they started from (`sft_start.json`); seeds trained on two
    machines start from two stages, and the start row is their mean (the table's own
    `sft/sft_eval.json` is then not used); unfinished runs' starts do not count."""
    table = _table()  # splits level1, arith_countdown_l2; 3 steps, seeds 0 and 1
    support.write_sft_eval(tmp_path, {"bf16": {"level1": 0.9, "arith_countdown_l2": 0.9}})
    starts = {0: (0.2, 0.1, "f-a"), 1: (0.4, 0.3, "f-b")}
    for seed, (l1, l2, fingerprint) in starts.items():
        for label in table.labels:
            d = support.write_run_logs(tmp_path, label, seed, [{"step": 2, "level1": 0.5}])
            record = {
                "rows": [
                    {"split": "level1", "pass@1_bf16": l1},
                    {"split": "arith_countdown_l2", "pass@1_bf16": l2},
                ],
                "params_fingerprint": fingerprint,
            }
            with open(f"{d}/sft_start.json", "w") as f:
                json.dump(record, f)
    row = agg.sft_row(table, str(tmp_path))
    assert row["run"] == "SFT starts (bf16, mean of 2)"
    assert row["level1"] == pytest.approx(0.3) and row["average"] == pytest.approx(0.2)
    assert [r["run"] for r in agg.sft_rows(table, str(tmp_path))] == [row["run"]]
    for label in table.labels:  # seed 1 unfinished: only seed 0's start is the table's
        support.write_run_logs(tmp_path, label, 1, [{"step": 1, "level1": 0.5}])
    row = agg.sft_row(table, str(tmp_path))
    assert row["run"] == "SFT start (bf16)" and row["level1"] == pytest.approx(0.2)


def test_curves_average_seeds_per_step_and_keep_the_bf16_scores(tmp_path):
    """Per step, the mean over seeds of reward, gap and KL (a key some step lacks is left out);
    per evaluation, the benchmark average in the run's own execution and, for FP4 runs scored
    in bf16 as well, in bf16."""
    table = _table()  # splits level1, arith_countdown_l2 (the benchmark); 3 steps, seeds 0, 1
    rng = np.random.default_rng(0)
    logged = {}
    for seed in table.seeds:
        metrics = [
            {"step": i, "reward": r, "train_rollout_gap_mean": g, "train_rollout_kl_k3": k}
            for i, (r, g, k) in enumerate(rng.random((3, 3)))
        ]
        evals = [
            {"step": i, "level1": 0.5, "arith_countdown_l2": a}
            | {"level1@bf16": 0.4, "arith_countdown_l2@bf16": b}
            for i, (a, b) in enumerate(rng.random((3, 2)))
        ]
        support.write_run_logs(tmp_path, "trace", seed, evals, metrics)
        del metrics[1]["train_rollout_kl_k3"]  # bf16: one step without its KL
        support.write_run_logs(tmp_path, "bf16", seed, [dict(e) for e in evals], metrics)
        logged[seed] = (metrics, evals)
    got = {c["run"]: c for c in agg.curves(table, str(tmp_path))}
    trace, bf16 = got["trace"], got["bf16"]
    for key in ("reward", "train_rollout_gap_mean"):
        want = [np.mean([logged[s][0][i][key] for s in table.seeds]) for i in range(3)]
        np.testing.assert_allclose(trace[key], want)
    kl = [np.mean([logged[s][0][i]["train_rollout_kl_k3"] for s in table.seeds]) for i in (0, 2)]
    np.testing.assert_allclose(np.asarray(trace["train_rollout_kl_k3"])[[0, 2]], kl)
    assert "train_rollout_kl_k3" not in bf16
    for key, split in (("score", "arith_countdown_l2"), ("score_bf16", "arith_countdown_l2@bf16")):
        want = [np.mean([logged[s][1][i][split] for s in table.seeds]) for i in range(3)]
        np.testing.assert_allclose(trace[key], want)
    for seed in table.seeds:  # without the bf16 scores in every evaluation: no bf16 curve
        evals = [{k: v for k, v in e.items() if "@" not in k} for e in logged[seed][1]]
        support.write_run_logs(tmp_path, "bf16", seed, evals, logged[seed][0])
    assert "score_bf16" not in {c["run"]: c for c in agg.curves(table, str(tmp_path))}["bf16"]


def test_runs_are_paired_with_bf16_seed_by_seed(tmp_path):
    """Each run's final benchmark average minus bf16's of the same seed: mean and sample std
    over the seeds both finished; the same for a policy scored in bf16 where every final
    evaluation has it."""
    table = _table()  # labels bf16, trace; splits level1, arith_countdown_l2; 3 steps; seeds 0, 1
    rng = np.random.default_rng(1)
    bf16, trace, trace_bf16 = rng.random((3, 2))
    for seed in (0, 1):
        support.write_run_logs(tmp_path, "bf16", seed, [
            {"step": 2, "level1": 0.9, "arith_countdown_l2": bf16[seed]}])  # fmt: skip
        support.write_run_logs(tmp_path, "trace", seed, [
            {"step": 2, "level1": 0.1, "arith_countdown_l2": trace[seed],
             "level1@bf16": 0.2, "arith_countdown_l2@bf16": trace_bf16[seed]}])  # fmt: skip
    (row,) = agg.paired_differences(table, str(tmp_path))
    assert row["run"] == "trace" and row["seeds"] == 2
    np.testing.assert_allclose(row["average - bf16"], np.mean(trace - bf16))
    np.testing.assert_allclose(row["average - bf16_std"], np.std(trace - bf16, ddof=1))
    np.testing.assert_allclose(row["average@bf16 - bf16"], np.mean(trace_bf16 - bf16))
    # bf16 seed 1 unfinished: one pair, no std; no bf16 scores in seed 0's trace: no such key.
    support.write_run_logs(tmp_path, "bf16", 1, [{"step": 1, "arith_countdown_l2": 0.0}])
    support.write_run_logs(tmp_path, "trace", 0, [{"step": 2, "arith_countdown_l2": 0.5}])
    (row,) = agg.paired_differences(table, str(tmp_path))
    assert row["seeds"] == 1 and np.isnan(row["average - bf16_std"])
    np.testing.assert_allclose(row["average - bf16"], 0.5 - bf16[0])
    assert "average@bf16 - bf16" not in row
    assert agg.paired_differences(table, str(tmp_path), reference="qarl") == []


def test_execution_gap_of_fp4_runs_at_end_and_start_seed_by_seed(tmp_path):
    """Per FP4 run and seed, the benchmark average in bf16 minus in NVFP4 at the last evaluation
    and at the seed's own SFT start (its `sft_start.json`, else the table's), and end minus
    start: mean and sample std over seeds; bf16 runs and seeds without bf16 scores have none."""
    table = _table()  # labels bf16, trace; splits level1, arith_countdown_l2 (the benchmark)
    rng = np.random.default_rng(2)
    own, in_bf16, start_fp4, start_bf16 = rng.random((4, 2))
    table_start = {"bf16": {"level1": 0.0, "arith_countdown_l2": 0.9},
                   "nvfp4": {"level1": 0.0, "arith_countdown_l2": 0.1}}  # fmt: skip
    support.write_sft_eval(tmp_path, table_start)
    for seed in table.seeds:
        support.write_run_logs(tmp_path, "bf16", seed, [{"step": 2, "arith_countdown_l2": 0.5}])
        d = support.write_run_logs(tmp_path, "trace", seed, [
            {"step": 2, "level1": 0.3, "arith_countdown_l2": own[seed], "level1@bf16": 0.9,
             "arith_countdown_l2@bf16": in_bf16[seed]}])  # fmt: skip
        rows = [{"split": "level1", "pass@1_bf16": 0.7, "pass@1_nvfp4": 0.2},
                {"split": "arith_countdown_l2", "pass@1_bf16": start_bf16[seed],
                 "pass@1_nvfp4": start_fp4[seed]}]  # fmt: skip
        if seed == 0:  # seed 1 has no record: the table's evaluation is its start
            with open(f"{d}/sft_start.json", "w") as f:
                json.dump({"rows": rows, "params_fingerprint": "f"}, f)
    start_gap = np.array([start_bf16[0] - start_fp4[0], 0.9 - 0.1])
    (row,) = agg.execution_gaps(table, str(tmp_path))
    assert row["run"] == "trace" and row["seeds"] == 2
    np.testing.assert_allclose(row["gap at end"], np.mean(in_bf16 - own))
    np.testing.assert_allclose(row["gap at start"], np.mean(start_gap))
    np.testing.assert_allclose(row["widened"], np.mean(in_bf16 - own - start_gap))
    np.testing.assert_allclose(row["widened_std"], np.std(in_bf16 - own - start_gap, ddof=1))
    support.write_run_logs(tmp_path, "trace", 1, [{"step": 2, "arith_countdown_l2": 0.5}])
    (row,) = agg.execution_gaps(table, str(tmp_path))  # seed 1 not scored in bf16
    assert row["seeds"] == 1 and np.isnan(row["gap at end_std"])
    np.testing.assert_allclose(row["gap at end"], in_bf16[0] - own[0])


def test_fp4_policies_scored_in_bf16_average_like_their_own_scores(tmp_path):
    """`average@bf16`: the benchmark average of a run's `<split>@bf16` final scores, mean and
    std over seeds; absent for a run whose evaluations did not score it in bf16."""
    table = _table()  # splits level1, arith_countdown_l2; 3 steps, seeds 0 and 1
    splits = table.experiment.eval.splits
    for seed in table.seeds:
        support.write_run_logs(
            tmp_path, "bf16", seed, [{"step": 2, "level1": 0.5, "arith_countdown_l2": 0.3}]
        )
        own = {"level1": 0.1, "arith_countdown_l2": 0.2 + 0.1 * seed}
        in_bf16 = {"level1@bf16": 0.9, "arith_countdown_l2@bf16": 0.4 + 0.2 * seed}
        support.write_run_logs(tmp_path, "trace", seed, [{"step": 2, **own, **in_bf16}])
    bf16, trace = agg.aggregate(table, str(tmp_path))
    want = [
        benchmark_average({s: 0.9 if s == "level1" else 0.4 + 0.2 * k for s in splits}, splits)
        for k in (0, 1)
    ]
    assert trace[agg.AVERAGE_BF16] == pytest.approx(np.mean(want))
    assert trace[f"{agg.AVERAGE_BF16}_std"] == pytest.approx(np.std(want, ddof=1))
    assert trace["average"] != trace[agg.AVERAGE_BF16]
    assert agg.AVERAGE_BF16 not in bf16
    support.write_run_logs(
        tmp_path, "trace", 1, [{"step": 2, "level1": 0.1, "arith_countdown_l2": 0.2}]
    )
    assert agg.AVERAGE_BF16 not in agg.aggregate(table, str(tmp_path))[1]  # one seed without
