"""The quickstart: SFT once, RL per method from it, and a table of what the stages measured."""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs import quickstart as quickstart_config
from experiments import quickstart
from trace_jax.quant import SiteMode
from trace_jax.rl import loop as rl_loop
from trace_jax.rl import sft as rl_sft
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.workdir import WorkdirConfigError

# One worker runs the shared smoke run (a module fixture) for every test of this module.
pytestmark = pytest.mark.xdist_group("quickstart_smoke_run")

METHODS = ("fp4_qat", "trace")


def _rows(rewards, gaps, mismatch_at=()):
    return [
        {"step": s, "reward": r, "train_rollout_gap_mean": g}
        | ({"code_mismatch": 0.1 * (s + 1)} if s in mismatch_at else {})
        for s, (r, g) in enumerate(zip(rewards, gaps, strict=True))
    ]


def test_method_summary_means_of_the_first_and_last_steps_and_of_the_measured_steps():
    rows = _rows([0.0, 0.2, 0.4, 0.5, 0.9], [0.01, 0.02, 0.03, 0.04, 0.05], mismatch_at=(0, 3))
    got = quickstart.method_summary(rows, 2)
    assert got == pytest.approx(
        {"reward_first": 0.1, "reward_last": 0.7, "gap": 0.03, "code_mismatch": 0.25}
    )
    assert "code_mismatch" not in quickstart.method_summary(_rows([1.0], [0.0]), 1)
    with pytest.raises(ValueError, match=r"smooth_steps=6 must be in \[1, 5 rows\]"):
        quickstart.method_summary(rows, 6)


def test_moving_average_of_full_windows():
    values = [3.0, 1.0, 4.0, 1.0, 5.0]
    want = [np.mean(values[i : i + 3]) for i in range(3)]
    np.testing.assert_allclose(quickstart.moving_average(values, 3), want)
    np.testing.assert_allclose(quickstart.moving_average(values, 1), values)
    with pytest.raises(ValueError, match=r"width=6 must be in \[1, 5 values\]"):
        quickstart.moving_average(values, 6)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rl.eval_every", 3, r"rl\.steps and rl\.eval_every disagree: 2 steps must be a mul"),
        ("rl.format", "mxfp4_w4a4", r"rl\.format must be 'nvfp4'"),
        ("quickstart.smooth_steps", 3, r"smooth_steps must be in \[1, rl\.steps=2\], got 3"),
        ("quickstart.methods", ("trace", "trace"), "must be distinct registered methods"),
        ("quickstart.methods", ("trace", "grpo"), r"methods \(.*\), got \('trace', 'grpo'\)"),
    ],
)
def test_settings_that_cannot_give_the_table_are_refused_before_any_work(
    tmp_path, field, value, message
):
    cd = quickstart_config.get_config("smoke")
    section, name = field.split(".")
    cd[section][name] = value
    with pytest.raises(ValueError, match=message):
        quickstart.run(cd, str(tmp_path))
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One smoke run of both methods (the 1-block model), with evaluation scores that tell the
    stages and executions apart (a model this small scores 0 everywhere, which would let a table
    that mixes up its columns pass)."""
    workdir = tmp_path_factory.mktemp("quickstart")
    rl_calls = []

    def sft_scores(model, config, keys, *, qcfg=None, mode=SiteMode.OFF):
        fp4 = 0.001 * (mode is SiteMode.RTN)
        return {s: 0.1 + 0.01 * i + fp4 for i, s in enumerate(config.splits)}

    def rl_scores(
        model, config, keys, *, qcfg=None, mode=SiteMode.OFF, implementation="auto", mesh=None
    ):
        rl_calls.append(mode)
        return {s: 0.5 + 0.1 * len(rl_calls) + 0.01 * i for i, s in enumerate(config.splits)}

    cd = quickstart_config.get_config("smoke")
    cd.eval.splits = ("level1", "arith_countdown_l2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rl_sft, "pass_at_1_by_split", sft_scores)
        mp.setattr(rl_loop, "pass_at_1_by_split", rl_scores)
        rows = quickstart.run(cd, str(workdir))
    assert rl_calls == [SiteMode.RTN, SiteMode.RTN]  # each method's final policy, in FP4
    return cd, workdir, rows


def test_the_table_holds_what_each_stage_measured(finished):
    _, workdir, rows = finished
    assert [r["method"] for r in rows] == list(METHODS)
    sft_rows = json.loads((workdir / "sft" / "sft_eval.json").read_text())["rows"]
    sft_eval = {r["split"]: r for r in sft_rows}
    for row in rows:
        rl_dir = workdir / f"rl_{row['method']}"
        metrics = read_rows(str(rl_dir / "rl_metrics.jsonl"))
        assert [m["step"] for m in metrics] == [0, 1]
        assert row["reward, first 1 steps"] == metrics[0]["reward"]
        assert row["reward, last 1 steps"] == metrics[1]["reward"]
        gaps = [m["train_rollout_gap_mean"] for m in metrics]
        assert row["train-rollout gap"] == pytest.approx(np.mean(gaps))
        assert "code_mismatch" not in metrics[1]  # measured every 2nd step: step 0 only
        assert row["code mismatch"] == metrics[0]["code_mismatch"]
        final = read_rows(str(rl_dir / "rl_eval.jsonl"))[-1]
        for split in ("level1", "arith_countdown_l2"):
            # FP4 rollouts: the SFT policy's NVFP4 score, not its bf16 one.
            assert row[f"{split} pass@1 after SFT"] == sft_eval[split]["pass@1_nvfp4"]
            assert sft_eval[split]["pass@1_nvfp4"] != sft_eval[split]["pass@1_bf16"]
            assert row[f"{split} pass@1 after RL"] == final[split]
    assert rows[0]["level1 pass@1 after RL"] != rows[1]["level1 pass@1 after RL"]


def test_the_artifacts_carry_the_table_and_the_curves(finished):
    _, workdir, rows = finished
    saved = json.loads((workdir / "quickstart.json").read_text())
    assert saved["rows"] == rows
    assert sorted(saved["seconds"]) == ["rl_fp4_qat", "rl_trace", "sft", "total"]
    for method in METHODS:
        metrics = read_rows(str(workdir / f"rl_{method}" / "rl_metrics.jsonl"))
        curve = saved["curves"][method]
        assert [c["step"] for c in curve] == [0, 1]
        assert [c["reward"] for c in curve] == [m["reward"] for m in metrics]
        assert curve[0]["code_mismatch"] == metrics[0]["code_mismatch"]
    md = (workdir / "quickstart.md").read_text()
    assert "| method |" in md and "| trace |" in md and "| fp4_qat |" in md
    assert (workdir / "quickstart.png").read_bytes()[:4] == b"\x89PNG"


def test_a_rerun_with_other_sft_settings_is_refused_before_any_stage(finished):
    """`sft.steps` 4 -> 10 in a finished workdir: the 4-step SFT stage is not reused as if it
    were the 10-step one (nor the RL runs started from it); the table stays as it was."""
    cd, workdir, _ = finished
    table_before = (workdir / "quickstart.md").read_text()
    other = cd.copy_and_resolve_references()
    other.sft.steps = 10
    with pytest.raises(WorkdirConfigError, match=r"sft\.steps: 4 -> 10.*--fresh"):
        quickstart.run(other, str(workdir))
    assert (workdir / "quickstart.md").read_text() == table_before
    assert "Reused" not in table_before  # the first run made every stage itself


def test_a_rerun_reuses_every_finished_stage_and_says_so(finished):
    cd, workdir, rows = finished
    metrics_before = (workdir / "rl_trace" / "rl_metrics.jsonl").read_text()
    again = quickstart.run(cd, str(workdir))  # no monkeypatch: any new evaluation would differ
    assert again == rows
    assert (workdir / "rl_trace" / "rl_metrics.jsonl").read_text() == metrics_before
    saved = json.loads((workdir / "quickstart.json").read_text())
    assert saved["seconds"]["sft"] == 0.0
    assert saved["reused"] == [
        f"SFT reused from {workdir / 'sft'}",
        *(f"RL {m} reused from {workdir / f'rl_{m}'}" for m in METHODS),
    ]
    md = (workdir / "quickstart.md").read_text()
    assert f"Reused from an earlier run: SFT reused from {workdir / 'sft'};" in md
