"""The paper-table driver: resumable (run, seed) runs; mean +- std from their final evals."""

from __future__ import annotations

import json

import jax
import matplotlib.axes
import matplotlib.pyplot
import ml_collections
import numpy as np
import pytest
from flax import nnx

from experiments import main as rl_main
from experiments import paper_table
from tests import tiny


def _cfg():
    cfg = tiny.experiment_config()
    cfg.sft.update(steps=4, batch_size=4, log_every=2, warmup_steps=1)
    cfg.eval.update(splits=("level1", "aime24"), problems_per_split=3, max_new_tokens=8)
    cfg.rl.update(
        steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_every=1,
        checkpoint_every=1, mismatch_every=0,  # mismatch metrics: test_rl_main (CI time)
    )  # fmt: skip
    cfg.table = ml_collections.ConfigDict(
        {
            "name": "t",
            "title": "test table",
            "seeds": (0, 1),
            "runs": (
                ("qat", {"rl.method": "fp4_qat"}),
                # Same method, another learning rate: different weights, shared compiled rollout
                # (CI time); method and layer overrides are plain rl.* fields like this one.
                ("qat lr", {"rl.method": "fp4_qat", "rl.learning_rate": 3e-3}),
            ),
        }
    )
    return cfg


def _score(model, problems, key, **kw):
    """A stand-in pass@1 that differs between runs and seeds (a function of the weights)."""
    del key, kw
    leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    return float(np.abs(np.asarray(leaf, np.float64)).sum() * 1e3 % 1.0) + 0.001 * len(problems)


def test_runs_resume_and_aggregate(tmp_path, monkeypatch):
    monkeypatch.setattr(rl_main, "evaluate_pass_at_1", _score)
    cfg, work, out = _cfg(), tmp_path / "work", tmp_path / "out"
    kw = dict(outdir=str(out), chunk_steps=1)
    assert paper_table.run(cfg, str(work), sft_only=True, **kw) is None
    assert (work / "sft" / "sft_checkpoint").exists() and not (work / "qat").exists()
    # A deadline already passed: no RL chunk starts, nothing is written.
    assert paper_table.run(cfg, str(work), deadline_s=0.0, **kw) is None
    assert not (work / "qat").exists() and not (out / "t.json").exists()
    # Two workers split the four (run, seed) pairs; neither writes the table.
    assert paper_table.run(cfg, str(work), shard=(1, 2), **kw) is None
    done = {(p.parent.name, p.name) for p in work.glob("*/seed*") if (p / "rl_eval.jsonl").exists()}
    assert done == {("qat", "seed1"), ("qat_lr", "seed1")} and not (out / "t.json").exists()
    assert paper_table.run(cfg, str(work), shard=(0, 2), **kw) is None
    rows = paper_table.run(cfg, str(work), **kw)  # everything finished: aggregates only
    assert [r["run"] for r in rows] == ["qat", "qat lr"]
    saved_finals = {}
    for row, (label, _) in zip(rows, cfg.table.runs, strict=True):
        finals = saved_finals[label] = []
        for seed in (0, 1):
            d = work / label.replace(" ", "_") / f"seed{seed}"
            evals = [json.loads(x) for x in (d / "rl_eval.jsonl").read_text().splitlines()]
            assert [e["step"] for e in evals] == [0, 1]
            finals.append(evals[-1])
        for split in ("level1", "aime24"):
            vals = [f[split] for f in finals]
            assert vals[0] != vals[1]  # the seeds really differ, so mean and std are tested
            np.testing.assert_allclose(row[split], np.mean(vals))
            np.testing.assert_allclose(row[f"{split}_std"], np.std(vals, ddof=1))
        np.testing.assert_allclose(row["average"], np.mean([f["aime24"] for f in finals]))
    saved = json.loads((out / "t.json").read_text())["rows"]
    # Where every run started: the SFT policy's bf16 pass@1, a reference row of the table.
    sft_eval = json.loads((work / "sft" / "sft_eval.json").read_text())["rows"]
    start = paper_table.sft_row(cfg, str(work))
    aime = [r["pass@1_bf16"] for r in sft_eval if r["split"] == "aime24"]
    assert start["average"] == pytest.approx(aime[0])  # the test config's one benchmark split
    assert "| SFT start (bf16) |" in (out / "t.md").read_text()
    # The FP4 methods are evaluated in FP4: the SFT start under the FP4 execution is shown too.
    assert [r["run"] for r in paper_table.sft_rows(cfg, str(work))] == [
        "SFT start (bf16)",
        "SFT start (nvfp4)",
    ]
    assert "| SFT start (nvfp4) |" in (out / "t.md").read_text()
    assert paper_table.sft_row(cfg, str(tmp_path / "none")) is None
    assert saved == json.loads(json.dumps(rows))
    # From the run logs alone (no checkpoints, no SFT stage: as brought back from a GPU session).
    logs = tmp_path / "logs"
    for f in work.glob("*/seed*/rl_*.jsonl"):
        (logs / f.relative_to(work)).parent.mkdir(parents=True, exist_ok=True)
        (logs / f.relative_to(work)).write_bytes(f.read_bytes())
    again = paper_table.run(cfg, str(logs), aggregate_only=True, **kw)
    assert json.loads(json.dumps(again)) == saved
    (logs / "qat" / "seed1" / "rl_eval.jsonl").unlink()
    with pytest.raises(RuntimeError, match="qat seed 1 has no final evaluation"):
        paper_table.run(cfg, str(logs), aggregate_only=True, **kw)
    # --partial: over the finished seeds, and the table says which are missing.
    part = paper_table.run(cfg, str(logs), aggregate_only=True, partial=True, **kw)
    assert [r["seeds"] for r in part] == [1, 2] and np.isnan(part[0]["level1_std"])
    np.testing.assert_allclose(part[0]["level1"], saved_finals["qat"][0]["level1"])
    assert part[1] == json.loads(json.dumps(again))[1]
    assert "Partial table**: seeds not yet run: qat (1 of 2)" in (out / "t.md").read_text()
    with pytest.raises(ValueError, match="--partial"):
        paper_table.run(cfg, str(logs), partial=True, **kw)
    assert (out / "t.png").stat().st_size > 0


def test_shards_partition_the_pairs():
    cfg = _cfg()
    pairs = [(lb, s) for lb, _, s in paper_table.table_pairs(cfg)]
    assert pairs == [("qat", 0), ("qat", 1), ("qat lr", 0), ("qat lr", 1)]
    split = [paper_table.table_pairs(cfg, (i, 3)) for i in range(3)]
    assert sorted((lb, s) for part in split for lb, _, s in part) == sorted(pairs)
    assert paper_table.parse_shard("2/3") == (2, 3) and paper_table.parse_shard("") == (0, 1)
    for bad in ("3/3", "a/b", "1"):
        with pytest.raises(ValueError, match="--shard"):
            paper_table.parse_shard(bad)
    # --runs: only the named runs, every seed, still split by shard.
    only = [(lb, s) for lb, _, s in paper_table.table_pairs(cfg, labels=("qat lr",))]
    assert only == [("qat lr", 0), ("qat lr", 1)]
    assert [(lb, s) for lb, _, s in paper_table.table_pairs(cfg, (1, 2), ("qat lr",))] == [
        ("qat lr", 1)
    ]
    with pytest.raises(ValueError, match="not runs of table"):
        paper_table.table_pairs(cfg, labels=("qat", "bf16"))


def test_bad_override(tmp_path):
    cfg = _cfg()
    with pytest.raises(ValueError, match="unknown override"):
        paper_table.run_config(cfg, "x", {"model.preset": "small"}, 0, "")


def test_run_statistics_average_logged_steps_then_seeds():
    seed0 = [
        {"step": 0, "train_rollout_gap_mean": 0.1, "code_mismatch": 0.2, "one_apart_fraction": 1.0},
        {"step": 1, "train_rollout_gap_mean": 0.3},
    ]
    seed1 = [{"step": 0, "train_rollout_gap_mean": 0.5, "code_mismatch": 0.4}]
    got = paper_table.run_statistics([seed0, seed1])
    assert got == pytest.approx(
        {"train_rollout_gap_mean": (0.2 + 0.5) / 2, "code_mismatch": 0.3, "one_apart_fraction": 1.0}
    )
    assert "train_rollout_kl_k3" not in got  # never logged: no number
    assert paper_table.run_statistics([[{"step": 0, "reward": 1.0}]]) == {}


def test_adaptation_finds_the_first_match_on_the_hardest_split(tmp_path):
    """Hardest split: the SFT policy's lowest; "match": run mean >= reference mean - its std."""
    cfg = _cfg()
    cfg.eval.splits = ("level1", "aime24", "aime25")
    cfg.rl.update(steps=3, eval_every=1)
    # aime25 is the hardest for the SFT policy; aime24 would be for the reference's last eval.
    sft_rows = [
        {"split": s, "pass@1_bf16": v}
        for s, v in (("level1", 0.1), ("aime24", 0.4), ("aime25", 0.2))
    ]
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "sft_eval.json").write_text(json.dumps({"rows": sft_rows}))
    ref = {0: [0.30, 0.40, 0.50], 1: [0.34, 0.44, 0.54]}  # per seed, steps 0..2
    run = {0: [0.20, 0.40, 0.60], 1: [0.24, 0.42, 0.50]}
    for label, vals in (("qat", ref), ("qat lr", run)):
        for seed, series in vals.items():
            d = tmp_path / label.replace(" ", "_") / f"seed{seed}"  # run dirs have no spaces
            d.mkdir(parents=True)
            rows = [{"step": i, "aime24": 0.0, "aime25": v} for i, v in enumerate(series)]
            (d / "rl_eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = paper_table.adaptation(cfg, str(tmp_path), run="qat lr", reference="qat")
    assert got["split"] == "aime25"
    # step 0: 0.22 < 0.32 - 0.028; step 1: 0.41 >= 0.42 - 0.028 -> matched at step 1.
    assert [p["step"] for p in got["points"]] == [0, 1, 2] and got["matched_at"] == 1
    np.testing.assert_allclose(got["points"][1]["ref_std"], np.std([0.40, 0.44], ddof=1))
    assert paper_table.adaptation(cfg, str(tmp_path), run="bf16", reference="qat") is None
    # Never within reach: no step.
    for seed in (0, 1):
        rows = [{"step": i, "aime24": 0.0, "aime25": 0.0} for i in range(3)]
        path = tmp_path / "qat_lr" / f"seed{seed}" / "rl_eval.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert paper_table.adaptation(cfg, str(tmp_path), "qat lr", "qat")["matched_at"] is None


def test_adaptation_curve_draws_both_runs_from_the_sft_score(monkeypatch):
    adapt = {
        "split": "aime25", "run": "trace", "reference": "bf16", "matched_at": 49,
        "points": [{"step": 49, "trace": 0.30, "bf16": 0.31, "ref_std": 0.02},
                   {"step": 99, "trace": 0.33, "bf16": 0.32, "ref_std": 0.01}],
    }  # fmt: skip
    calls = []
    for method in ("errorbar", "plot", "axvline"):
        real = getattr(matplotlib.axes.Axes, method)

        def record(self, *args, _m=method, _real=real, **kw):
            calls.append((_m, args, kw.get("yerr")))
            return _real(self, *args, **kw)

        monkeypatch.setattr(matplotlib.axes.Axes, method, record)
    fig, ax = matplotlib.pyplot.subplots()
    paper_table.plot_adaptation(ax, adapt, sft_score=0.2)
    matplotlib.pyplot.close(fig)
    assert calls[0] == ("errorbar", ([-1, 49, 99], [0.2, 0.31, 0.32]), [0.0, 0.02, 0.01])
    assert calls[1][:2] == ("plot", ([-1, 49, 99], [0.2, 0.30, 0.33], "s-"))
    assert calls[2][:2] == ("axvline", (49,))
    calls.clear()
    fig, ax = matplotlib.pyplot.subplots()
    paper_table.plot_adaptation(ax, {**adapt, "matched_at": None}, sft_score=None)
    matplotlib.pyplot.close(fig)
    assert calls[0] == ("errorbar", ([49, 99], [0.31, 0.32]), [0.02, 0.01])
    assert [c[0] for c in calls] == ["errorbar", "plot"]  # never matched: no line


def test_shared_runs_name_the_run_each_copy_came_from(tmp_path):
    cfg = _cfg()
    for label, _ in cfg.table.runs:  # two finished-looking runs; one is a copy of another's
        for seed in cfg.table.seeds:
            (tmp_path / label.replace(" ", "_") / f"seed{seed}").mkdir(parents=True)
    copy = tmp_path / "qat_lr" / "seed1" / "same_run_as.txt"
    copy.write_text("table7_policies/trace/seed1\n")
    assert paper_table.shared_runs(cfg, str(tmp_path)) == [
        ("qat lr", 1, "table7_policies/trace/seed1")
    ]
