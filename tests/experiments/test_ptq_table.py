"""The Table 7 driver on `tiny`: every recipe evaluated with FP4 execution, policies loaded from
saved params and from an RL workdir."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import main as rl_main
from experiments import ptq_table, sft
from tests import tiny
from trace_jax.models import init_model
from trace_jax.quant import ptq


def test_ptq_table_rows(tmp_path):
    cfg = tiny.experiment_config()
    cfg.eval.update(splits=("level1", "aime24"), problems_per_split=2, max_new_tokens=6)
    cfg.rl.update(
        steps=1, prompts_per_step=2, group_size=2, max_new_tokens=6, eval_every=0, mismatch_every=0
    )
    params = [str(tmp_path / f"bf16_params{k}") for k in (0, 1)]  # two "seeds"
    for k, path in enumerate(params):
        sft.save_params(init_model(sft.model_config(cfg), seed=cfg.seed + k), path)
    rl_main.run(cfg, str(tmp_path / "trace_run"))
    rows = ptq_table.run(
        cfg,
        bf16_policies=params,
        trace_policies=[str(tmp_path / "trace_run")] * 2,
        calibration_prompts=4,
        outdir=str(tmp_path / "out"),
        name="t7",
    )
    assert [r["policy"].split(",")[0] for r in rows] == [
        "BF16-trained",
        *(f"BF16-trained + {r} PTQ" for r in ptq.RECIPES),
        "TRACE final policy",
    ]
    for r in rows:
        assert r["seeds"] == 2 and 0.0 <= r["average"] <= 1.0
        for key in ("level1", "aime24", "average"):
            vals = r[f"{key}_seeds"]
            np.testing.assert_allclose(r[key], np.mean(vals))
            np.testing.assert_allclose(r[f"{key}_std"], np.std(vals, ddof=1))
        # The benchmark average, as in every table: level1 (the training distribution) is out.
        np.testing.assert_allclose(r["average_seeds"], r["aime24_seeds"])
    errors = [r["weight_sq_error_seeds"] for r in rows if "weight_sq_error" in r]
    assert len(errors) == 3 and all(e[0] > 0 and e[0] != e[1] for e in errors)  # seeds differ
    for r in rows[1:4]:  # the weight error differs between seeds: its std is not 0
        vals = r["weight_sq_error_seeds"]
        np.testing.assert_allclose(r["weight_sq_error_std"], np.std(vals, ddof=1), rtol=1e-6)
    saved = json.loads((tmp_path / "out" / "t7.json").read_text())
    assert len(saved["rows"]) == 5
    assert "Table 7 analog" in (tmp_path / "out" / "t7.md").read_text()
    assert (tmp_path / "out" / "t7.png").read_bytes()[:4] == b"\x89PNG"  # the bar chart
    (tmp_path / "out" / "t7.png").unlink()  # redrawn from the JSON alone
    png = ptq_table.plot_from(str(tmp_path / "out" / "t7.json"))
    assert png == str(tmp_path / "out" / "t7.png")
    assert (tmp_path / "out" / "t7.png").exists()
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"run": "bf16"}]}))
    with pytest.raises(ValueError, match=r"not a result written by experiments\.ptq_table"):
        ptq_table.plot_from(str(tmp_path / "other.json"))
    with pytest.raises(ValueError, match="one TRACE policy per seed"):
        ptq_table.run(cfg, bf16_policies=params, trace_policies=params[:1])


def test_seed_rows_are_saved_reused_and_recomputed_per_policy(tmp_path, monkeypatch):
    calls = []

    def fake_bf16_rows(cfg, bf16, calibration):
        calls.append(("bf16", bf16, calibration))
        return [{"policy": "b", "average": float(len(bf16) + 100 * calibration)}]

    def fake_trace_row(cfg, trace):
        calls.append(("trace", trace))
        return {"policy": "t", "average": float(10 * len(trace))}

    monkeypatch.setattr(ptq_table, "bf16_policy_rows", fake_bf16_rows)
    monkeypatch.setattr(ptq_table, "trace_policy_row", fake_trace_row)
    cfg = tiny.experiment_config()
    kw = dict(outdir=str(tmp_path), name="t7", calibration_prompts=1)
    # The BF16 policies first (TRACE still training): a table without the TRACE row.
    rows = ptq_table.run(cfg, bf16_policies=["a", "bb"], **kw)
    assert calls == [("bf16", "a", 1), ("bf16", "bb", 1)] and len(rows) == 1
    assert rows[0]["average_seeds"] == [101.0, 102.0]
    # Then with TRACE's policies: only TRACE's rows are computed.
    calls.clear()
    rows = ptq_table.run(cfg, bf16_policies=["a", "bb"], trace_policies=["t", "tt"], **kw)
    assert calls == [("trace", "t"), ("trace", "tt")]
    assert [r["average_seeds"] for r in rows] == [[101.0, 102.0], [10.0, 20.0]]
    # A changed policy or calibration recomputes that part of that seed only.
    calls.clear()
    rows = ptq_table.run(cfg, bf16_policies=["a", "ccc"], trace_policies=["t", "tt"], **kw)
    assert calls == [("bf16", "ccc", 1)] and rows[0]["average_seeds"] == [101.0, 103.0]
    calls.clear()
    ptq_table.run(cfg, bf16_policies=["a"], **{**kw, "calibration_prompts": 2})
    assert calls == [("bf16", "a", 2)]
    # A worker evaluates its one seed and writes no table.
    calls.clear()
    (tmp_path / "t7.json").unlink()
    ptq_table.run(cfg, bf16_policies=["x", "y"], worker_seed=1, **kw)
    assert calls == [("bf16", "y", 1)] and not (tmp_path / "t7.json").exists()


def test_missing_policy_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no policy at"):
        ptq_table.load_policy(tiny.experiment_config(), str(tmp_path / "nowhere"))


def test_average_is_over_the_benchmark_splits(monkeypatch):
    cfg = tiny.experiment_config()
    cfg.eval.update(splits=("level1", "aime24", "aime25"), problems_per_split=1)
    scores = iter([0.9, 0.2, 0.4])  # level1 (training distribution) is left out of the average
    monkeypatch.setattr(ptq_table, "evaluate_pass_at_1", lambda *a, **k: next(scores))
    row = ptq_table._scores(cfg, None, None, None)
    assert row["level1"] == 0.9 and row["average"] == pytest.approx(0.3)


def test_a_policy_short_of_its_final_step_is_refused(tmp_path):
    """The table's policies are final: a run whose latest checkpoint is step 0 of its 2 steps is
    refused before anything is restored (the check reads the step only)."""
    cfg = tiny.experiment_config()
    cfg.rl.steps = 2
    mngr = rl_main._checkpointer(str(tmp_path / "run"), 1)
    mngr.save(0, args=rl_main.ocp.args.StandardSave({"x": np.zeros(2)}))
    mngr.wait_until_finished()
    with pytest.raises(ValueError, match="latest checkpoint is step 0, not the final step 1"):
        ptq_table.load_policy(cfg, str(tmp_path / "run"))
