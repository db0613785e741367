"""Training a table on `tiny`: SFT once, resumable chunks, worker shards, a deadline; then its
aggregation from the run logs (mean +- std over seeds of the final evaluations)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.tables import support
from trace_jax.tables import aggregate as agg
from trace_jax.tables.grid import run_dir
from trace_jax.tables.train import final_eval, steps_done

pytestmark = pytest.mark.xdist_group(support.TRAINED_TABLE)


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_driver_calls_train_each_pair_once_to_the_end(trained_table):
    t = trained_table
    assert (t.workdir / "sft" / "sft_checkpoint").exists()
    assert not t.deadline_passed and t.dirs_after_deadline == ["sft"]  # no chunk started
    assert t.shard1 == {("bf16", 1), ("trace", 1)}  # worker 1 of 2: pairs 1 and 3
    assert t.all_done
    for label in t.table.labels:
        for seed in t.table.seeds:
            d = t.workdir / label / f"seed{seed}"
            # Chunks of 2 steps: the second chunk resumed at step 2 from the checkpoint of step 1.
            assert [r["step"] for r in _rows(d / "rl_metrics.jsonl")] == [0, 1, 2]
            assert [r["step"] for r in _rows(d / "rl_eval.jsonl")] == [0, 1, 2]
            assert steps_done(str(d)) == 3
            assert final_eval(str(d), 3) == _rows(d / "rl_eval.jsonl")[-1]
            # Each run records the SFT stage it started from (evaluation and fingerprint).
            sft = (t.workdir / "sft" / "sft_eval.json").read_text()
            assert (d / "sft_start.json").read_text() == sft and "params_fingerprint" in sft


def test_aggregate_is_mean_and_std_of_the_final_evaluations(trained_table):
    t = trained_table
    rows = agg.aggregate(t.table, str(t.workdir))
    assert [r["run"] for r in rows] == ["bf16", "trace"]
    finals = {}
    for row in rows:
        finals[row["run"]] = [
            _rows(t.workdir / row["run"] / f"seed{s}" / "rl_eval.jsonl")[-1] for s in (0, 1)
        ]
        assert row["seeds"] == 2 and row["rl.method"] == row["run"]
        for split in ("level1", "arith_countdown_l2"):
            vals = [f[split] for f in finals[row["run"]]]
            assert vals[0] != vals[1]  # the seeds really differ, so mean and std are tested
            np.testing.assert_allclose(row[split], np.mean(vals))
            np.testing.assert_allclose(row[f"{split}_std"], np.std(vals, ddof=1))
        # `average` is over the benchmark splits only: level1 is the training distribution.
        bench = [f["arith_countdown_l2"] for f in finals[row["run"]]]
        np.testing.assert_allclose(row["average"], np.mean(bench))
        assert row["train_rollout_gap_mean"] >= 0.0  # a log statistic of the run
    # each run its own logs
    assert finals["bf16"][0]["arith_countdown_l2"] != finals["trace"][0]["arith_countdown_l2"]
    # Where every run started: the SFT policy under bf16 and under NVFP4 execution.
    sft = json.loads((t.workdir / "sft" / "sft_eval.json").read_text())["rows"]
    start = agg.sft_rows(t.table, str(t.workdir))
    assert [r["run"] for r in start] == ["SFT start (bf16)", "SFT start (nvfp4)"]
    assert start[1]["average"] == pytest.approx(
        next(r["pass@1_nvfp4"] for r in sft if r["split"] == "arith_countdown_l2")
    )
    curves = {c["run"]: c for c in agg.curves(t.table, str(t.workdir))}
    assert curves["trace"]["eval_steps"] == [0, 1, 2] and len(curves["bf16"]["reward"]) == 3
    np.testing.assert_allclose(
        curves["trace"]["score"][-1], np.mean([f["arith_countdown_l2"] for f in finals["trace"]])
    )


def test_unfinished_seeds_are_an_error_or_left_out(trained_table, tmp_path):
    t = trained_table
    logs = tmp_path / "logs"  # the run logs alone, as brought back from a GPU machine
    for f in t.workdir.glob("*/seed*/rl_*.jsonl"):
        (logs / f.relative_to(t.workdir)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, logs / f.relative_to(t.workdir))
    full = agg.aggregate(t.table, str(logs))
    assert full == agg.aggregate(t.table, str(t.workdir))
    (logs / "bf16" / "seed1" / "rl_eval.jsonl").unlink()
    with pytest.raises(RuntimeError, match="bf16 seed 1 has no final evaluation"):
        agg.aggregate(t.table, str(logs))
    part = agg.aggregate(t.table, str(logs), partial=True)
    assert [r["seeds"] for r in part] == [1, 2] and np.isnan(part[0]["level1_std"])
    final = _rows(t.workdir / "bf16" / "seed0" / "rl_eval.jsonl")[-1]
    assert part[0]["level1"] == final["level1"] and part[1] == full[1]
    assert agg.missing_seeds(t.table, part) == ["bf16 (1 of 2)"]
    shutil.rmtree(run_dir(str(logs), "bf16", 0))
    part = agg.aggregate(t.table, str(logs), partial=True)
    assert [r["run"] for r in part] == ["trace"]
    assert agg.missing_seeds(t.table, part) == ["bf16"]
