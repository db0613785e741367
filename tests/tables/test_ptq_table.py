"""The Table 7 rows on `tiny`: every PTQ recipe evaluated with FP4 execution, policies loaded
from RL workdirs and from saved params; per-seed rows kept and reused."""

from __future__ import annotations

import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests import tiny
from tests.tables import support
from trace_jax.quant import ptq
from trace_jax.rl import evaluate
from trace_jax.rl.checkpoint import checkpoint_manager
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables import ptq_table
from trace_jax.tables.grid import run_dir


def _config(**rl):
    cd = tiny.experiment_config()
    cd.rl.update(rl)
    return ExperimentConfig.from_config_dict(cd)


@pytest.mark.xdist_group(support.TRAINED_TABLE)
def test_rows_of_trained_policies(trained_table, tmp_path):
    t = trained_table
    config = t.table.experiment
    # Seed 0's BF16 policy is an RL workdir, seed 1's saved params (the SFT warm start).
    bf16 = [run_dir(str(t.workdir), "bf16", 0), str(t.workdir / "sft" / "sft_checkpoint")]
    trace = [run_dir(str(t.workdir), "trace", s) for s in (0, 1)]
    per_seed = [
        ptq_table.seed_rows(config, str(tmp_path), "t7", k, bf16[k], trace[k], 4) for k in (0, 1)
    ]
    rows = ptq_table.over_seeds(per_seed)
    assert [r["policy"].split(",")[0] for r in rows] == [
        "BF16-trained",
        *(f"BF16-trained + {r} PTQ" for r in ptq.RECIPES),
        "TRACE final policy",
    ]
    for r in rows:
        assert r["seeds"] == 2 and 0.0 <= r["average"] <= 1.0
        for key in ("level1", "arith_countdown_l2", "average"):
            vals = r[f"{key}_seeds"]
            np.testing.assert_allclose(r[key], np.mean(vals))
            np.testing.assert_allclose(r[f"{key}_std"], np.std(vals, ddof=1))
        # The benchmark average, as in every table: level1 (the training distribution) is out.
        np.testing.assert_allclose(r["average_seeds"], r["arith_countdown_l2_seeds"])
    errors = [r["weight_sq_error_seeds"] for r in rows if "weight_sq_error" in r]
    assert len(errors) == 3 and all(e[0] > 0 and e[0] != e[1] for e in errors)  # seeds differ
    for r in rows[1:4]:  # the weight error differs between seeds: its std is not 0
        vals = r["weight_sq_error_seeds"]
        np.testing.assert_allclose(r["weight_sq_error_std"], np.std(vals, ddof=1), rtol=1e-6)
    assert (tmp_path / "t7_seeds" / "seed1.json").exists()


def test_seed_rows_are_saved_reused_and_recomputed_per_policy(tmp_path, monkeypatch):
    calls = []

    def fake_bf16_rows(config, bf16, calibration):
        calls.append(("bf16", bf16, calibration))
        return [{"policy": "b", "average": float(len(bf16) + 100 * calibration)}]

    def fake_trace_row(config, trace):
        calls.append(("trace", trace))
        return {"policy": "t", "average": float(10 * len(trace))}

    monkeypatch.setattr(ptq_table, "bf16_policy_rows", fake_bf16_rows)
    monkeypatch.setattr(ptq_table, "trace_policy_row", fake_trace_row)
    config = _config()

    def rows(bf16, trace=(), calibration=1):
        pairs = ptq_table.policy_pairs(bf16, trace)
        per_seed = [
            ptq_table.seed_rows(config, str(tmp_path), "t7", k, b, t, calibration)
            for k, (b, t) in enumerate(pairs)
        ]
        return ptq_table.over_seeds(per_seed)

    # The BF16 policies first (TRACE still training): a table without the TRACE row.
    got = rows(["a", "bb"])
    assert calls == [("bf16", "a", 1), ("bf16", "bb", 1)] and len(got) == 1
    assert got[0]["average_seeds"] == [101.0, 102.0]
    # Then with TRACE's policies: only TRACE's rows are computed.
    calls.clear()
    got = rows(["a", "bb"], ["t", "tt"])
    assert calls == [("trace", "t"), ("trace", "tt")]
    assert [r["average_seeds"] for r in got] == [[101.0, 102.0], [10.0, 20.0]]
    # A changed policy or calibration recomputes that part of that seed only.
    calls.clear()
    got = rows(["a", "ccc"], ["t", "tt"])
    assert calls == [("bf16", "ccc", 1)] and got[0]["average_seeds"] == [101.0, 103.0]
    calls.clear()
    rows(["a"], calibration=2)
    assert calls == [("bf16", "a", 2)]
    with pytest.raises(ValueError, match="one TRACE policy per seed"):
        ptq_table.policy_pairs(["a", "b"], ["t"])
    with pytest.raises(ValueError, match="at least one BF16"):
        ptq_table.policy_pairs([], [])


def test_seed_rows_kept_under_older_split_names_read_under_the_current_ones(tmp_path):
    path = ptq_table.seed_rows_path(str(tmp_path), "t7", 0)
    os.makedirs(os.path.dirname(path))
    row = {"policy": "b", "aime24": 0.25, "livecodebench": 0.5, "average": 0.375}
    source = {"policy": "a", "calibration_prompts": 1}
    with open(path, "w") as f:
        json.dump({"bf16": {"source": source, "rows": [row]}}, f)
    got = ptq_table.seed_rows(_config(), str(tmp_path), "t7", 0, "a", "", 1)  # reused, not run
    assert got == [
        {"policy": "b", "arith_countdown_l2": 0.25, "program_l2to4": 0.5, "average": 0.375}
    ]


def test_missing_policy_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no policy at"):
        ptq_table.load_policy(_config(), str(tmp_path / "nowhere"))


def test_average_is_over_the_benchmark_splits(monkeypatch):
    cd = tiny.experiment_config()
    cd.eval.update(
        splits=("level1", "arith_countdown_l2", "arith_countdown_l3"), problems_per_split=1
    )
    scores = iter([0.9, 0.2, 0.4])  # level1 (training distribution) is left out of the average
    monkeypatch.setattr(evaluate, "evaluate_pass_at_1", lambda *a, **k: next(scores))
    row = ptq_table.scores(ExperimentConfig.from_config_dict(cd), None, None, None)
    assert row["level1"] == 0.9 and row["average"] == pytest.approx(0.3)


def test_a_policy_short_of_its_final_step_is_refused(tmp_path):
    """The table's policies are final: a run whose latest checkpoint is step 0 of its 2 steps is
    refused before anything is restored (the check reads the step only)."""
    manager = checkpoint_manager(str(tmp_path / "run" / "rl_checkpoints"), 1)
    manager.save(0, args=ocp.args.StandardSave({"x": np.zeros(2)}))
    manager.wait_until_finished()
    manager.close()
    with pytest.raises(ValueError, match="latest checkpoint is step 0, not the final step 1"):
        ptq_table.load_policy(_config(steps=2), str(tmp_path / "run"))
