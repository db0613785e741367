"""The paper-table entry point: the written table from run logs, partial tables, flags."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import matplotlib.axes
import matplotlib.pyplot
import pytest

from experiments import paper_table
from tests.tables import support
from trace_jax.tables import aggregate as agg
from trace_jax.tables.grid import Table
from trace_jax.tasks import SPLIT_NAMES

ROOT = pathlib.Path(__file__).parents[2]


def _logs(workdir, seeds_done=((0, 1), (0, 1)), in_bf16=False):
    """Run logs of the support table: final pass@1 differing by run and seed; `in_bf16`: the
    FP4 run (trace) scored in bf16 as well, 0.2 above its own score."""
    table = Table.from_config_dict(support.table_config())
    for label, seeds in zip(table.labels, seeds_done, strict=True):
        for seed in seeds:
            v = 0.1 * (1 + seed) + (0.5 if label == "trace" else 0.0)
            evals = [
                {"step": s, "level1": 0.9, "arith_countdown_l2": v - 0.01 * (2 - s)}
                for s in range(3)
            ]
            if in_bf16 and label == "trace":
                for e in evals:
                    e.update(
                        {
                            "level1@bf16": 0.9,
                            "arith_countdown_l2@bf16": e["arith_countdown_l2"] + 0.2,
                        }
                    )
            metrics = [{"step": s, "reward": v, "train_rollout_gap_mean": 0.01} for s in range(3)]
            support.write_run_logs(workdir, label, seed, evals, metrics)
    sft_scores = {
        "bf16": {"level1": 0.5, "arith_countdown_l2": 0.05},
        "nvfp4": {"level1": 0.4, "arith_countdown_l2": 0.04},
    }
    support.write_sft_eval(workdir, sft_scores)
    return table


def test_the_table_from_run_logs(tmp_path):
    table = _logs(tmp_path / "w")
    out = tmp_path / "out"
    rows = paper_table.run(table, str(tmp_path / "w"), outdir=str(out), aggregate_only=True)
    assert rows == agg.aggregate(table, str(tmp_path / "w"))
    assert json.loads((out / "t.json").read_text())["rows"] == json.loads(json.dumps(rows))
    md = (out / "t.md").read_text()
    assert "| SFT start (bf16) |" in md and "| SFT start (nvfp4) |" in md
    assert "Aggregated from the run logs" in md and "Partial table" not in md
    # trace (0.6, 0.7 at the last step) matches bf16 (0.1, 0.2) at once on the only benchmark split.
    assert (
        "on the hardest split (`arith_countdown_l2`" in md
        and "first matches `bf16` at step 0" in md
    )
    assert (out / "t.png").stat().st_size > 0


def test_fp4_runs_scored_in_bf16_get_their_column(tmp_path):
    """Logs with `<split>@bf16` give the table an `average@bf16` column (n/a for the bf16 run)
    and a note saying what it is; logs without give neither."""
    for in_bf16 in (True, False):
        table = _logs(tmp_path / f"w{in_bf16}", in_bf16=in_bf16)
        out = tmp_path / f"out{in_bf16}"
        paper_table.run(table, str(tmp_path / f"w{in_bf16}"), outdir=str(out), aggregate_only=True)
        md = (out / "t.md").read_text()
        header = next(line for line in md.splitlines() if line.startswith("| run | average |"))
        assert ("| average@bf16 | average@bf16_std |" in header) == in_bf16
        assert ("the same average with each FP4 run's policy run in bf16" in md) == in_bf16
        # Paired by seed: trace's own average is 0.5 above bf16's in every seed, in bf16 0.7.
        paired = md.split("Paired by seed against `bf16`")[1]
        assert "| trace | 0.500 |" in paired and ("| 0.700 |" in paired) == in_bf16
        if in_bf16:
            trace = next(line for line in md.splitlines() if line.startswith("| trace |"))
            cells = [c.strip() for c in trace.split("|")[1:-1]]
            columns = [c.strip() for c in header.split("|")[1:-1]]
            assert float(cells[columns.index("average@bf16")]) == pytest.approx(
                float(cells[columns.index("average")]) + 0.2, abs=1e-3
            )


def test_a_partial_table_says_what_is_missing(tmp_path):
    table = _logs(tmp_path / "w", seeds_done=((0,), (0, 1)))
    out = tmp_path / "out"
    kw = dict(outdir=str(out), aggregate_only=True)
    with pytest.raises(RuntimeError, match="bf16 seed 1 has no final evaluation"):
        paper_table.run(table, str(tmp_path / "w"), **kw)
    assert not (out / "t.json").exists()  # an incomplete table writes nothing
    rows = paper_table.run(table, str(tmp_path / "w"), partial=True, **kw)
    assert [r["seeds"] for r in rows] == [1, 2]
    assert "**Partial table**: seeds not yet run: bf16 (1 of 2)" in (out / "t.md").read_text()
    with pytest.raises(ValueError, match="--partial"):
        paper_table.run(table, str(tmp_path / "w"), outdir=str(out), partial=True)


def test_only_a_finished_full_table_is_written(tmp_path, monkeypatch):
    """Workers (`--shard`, `--runs`), an unfinished training (deadline) and `--sft_only` write
    no table; a plain run writes it once training says every pair is finished."""
    table = _logs(tmp_path / "w")
    calls, finished = [], []
    monkeypatch.setattr(paper_table, "run_sft_stage", lambda *a: calls.append("sft"))

    def fake_train(table, workdir, *, deadline_s, shard, labels):
        calls.append((deadline_s, shard, tuple(labels)))
        return bool(finished)

    monkeypatch.setattr(paper_table, "train_runs", fake_train)
    kw = dict(outdir=str(tmp_path / "out"))
    assert paper_table.run(table, str(tmp_path / "w"), sft_only=True, **kw) is None
    assert paper_table.run(table, str(tmp_path / "w"), deadline_s=5.0, **kw) is None
    finished.append(True)
    assert paper_table.run(table, str(tmp_path / "w"), shard=(1, 2), **kw) is None
    assert paper_table.run(table, str(tmp_path / "w"), labels=("trace",), **kw) is None
    assert calls == ["sft", (5.0, (0, 1), ()), (None, (1, 2), ()), (None, (0, 1), ("trace",))]
    assert not (tmp_path / "out").exists()
    rows = paper_table.run(table, str(tmp_path / "w"), **kw)
    assert [r["run"] for r in rows] == ["bf16", "trace"] and (tmp_path / "out" / "t.md").exists()
    assert "Aggregated from the run logs" not in (tmp_path / "out" / "t.md").read_text()


def test_parse_shard():
    assert paper_table.parse_shard("2/3") == (2, 3) and paper_table.parse_shard("") == (0, 1)
    for bad in ("3/3", "a/b", "1"):
        with pytest.raises(ValueError, match="--shard"):
            paper_table.parse_shard(bad)


def test_adaptation_curve_draws_each_run_from_its_own_sft_score(monkeypatch):
    adapt = {
        "split": "arith_countdown_l3", "run": "trace", "reference": "bf16", "matched_at": 49,
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
    paper_table.plot_adaptation(ax, adapt, {"bf16": 0.2, "trace": 0.15})
    matplotlib.pyplot.close(fig)
    assert calls[0] == ("errorbar", ([-1, 49, 99], [0.2, 0.31, 0.32]), [0.0, 0.02, 0.01])
    assert calls[1][:2] == ("plot", ([-1, 49, 99], [0.15, 0.30, 0.33], "s-"))
    assert calls[2][:2] == ("axvline", (49,))
    calls.clear()
    fig, ax = matplotlib.pyplot.subplots()
    paper_table.plot_adaptation(ax, {**adapt, "matched_at": None}, {"bf16": 0.2})
    matplotlib.pyplot.close(fig)
    assert calls[0] == ("errorbar", ([49, 99], [0.31, 0.32]), [0.02, 0.01])
    assert [c[0] for c in calls] == ["errorbar", "plot"]  # never matched: no line


def test_command_line_writes_a_partial_table_from_logs(tmp_path):
    """The entry point as launched: a locked table config with overrides, from logs alone."""
    for seed in (0, 1):
        scores = {s: 0.1 * seed for s in SPLIT_NAMES}
        evals = [{"step": 9, **scores}]
        support.write_run_logs(tmp_path / "w", "trace all", seed, evals)
    cmd = [
        sys.executable, "-m", "experiments.paper_table", "--config=configs/table5_layers.py",
        "--config.rl.steps=10", "--config.rl.eval_every=5", "--config.table.seeds=0,1",
        f"--workdir={tmp_path / 'w'}", f"--outdir={tmp_path}", "--aggregate_only", "--partial",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    saved = json.loads((tmp_path / "table5_layers.json").read_text())
    assert [(r["run"], r["seeds"]) for r in saved["rows"]] == [("trace all", 2)]
    assert "--config.rl.steps=10" in saved["meta"]["command"]
    md = (tmp_path / "table5_layers.md").read_text()
    assert "seeds not yet run: trace half, trace quarter, trace eighth" in md


def test_the_figure_draws_fp4_policies_scored_in_bf16_from_the_bf16_start(tmp_path, monkeypatch):
    """The score panel: each run from its SFT start under its own execution; an FP4 run scored
    in bf16 as well gets a dashed curve from the bf16 start."""
    table = _logs(tmp_path / "w", in_bf16=True)
    calls = []
    real = matplotlib.axes.Axes.plot

    def record(self, *args, **kw):
        calls.append((args, kw.get("label")))
        return real(self, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record)
    paper_table.plot(table, str(tmp_path / "w"), str(tmp_path / "f.png"))
    scores = {label: args for args, label in calls if len(args) == 3}  # (steps, y, style)
    steps, own, style = scores["trace"]
    assert steps == [-1, 0, 1, 2] and style == "o-" and own[0] == 0.04  # the NVFP4 start
    steps, in_bf16, style = scores["trace (in bf16)"]
    assert style == "s--" and in_bf16[0] == 0.05  # the bf16 start
    assert in_bf16[1:] == pytest.approx([x + 0.2 for x in own[1:]])
    assert "bf16 (in bf16)" not in scores  # the bf16 run has no second curve
    assert (tmp_path / "f.png").stat().st_size > 0
