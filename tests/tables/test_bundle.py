"""The bundle of a queue root: run logs and evaluations only; unpacked one folder per table."""

from __future__ import annotations

import tarfile

import pytest

from trace_jax.tables.bundle import EVENTS_FILE, bundle, unpack_bundle


def test_bundle_keeps_logs_and_evaluations_only(tmp_path):
    root = tmp_path / "root"
    keep = [
        "t1/trace/seed0/rl_metrics.jsonl",
        "t1/trace/seed0/rl_eval.jsonl",
        "t1/trace/seed1/same_run_as.txt",
        "t1/bf16/seed0/adopted_from.txt",
        "sft/sft_eval.json",
        "sft/sft_metrics.jsonl",
        "logs/t1_trace_seed0.0.log",
        EVENTS_FILE,
    ]
    drop = [
        "t1/trace/seed0/rl_checkpoints/25/x.json",
        "t1/trace/seed0/guidance/run/step_1/manifest.json",
        "sft/sft_checkpoint/rl_eval.jsonl",
        "t1/trace/seed0/tensorboard/events.out",
        "t1/trace/seed0/rl_curves.png",
    ]
    for rel in keep + drop:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    names = bundle(str(root), str(tmp_path / "b.tgz"))
    assert sorted(names) == sorted(keep)
    with tarfile.open(tmp_path / "b.tgz") as tar:
        assert sorted(tar.getnames()) == sorted(keep)


def test_unpack_bundle_places_runs_sft_and_logs_per_table(tmp_path):
    root = tmp_path / "root"
    files = {
        "t1/trace/seed0/rl_eval.jsonl": "new",
        "t1/trace/seed0/sft_start.json": "start",
        "t1/bf16/seed0/rl_eval.jsonl": "copy",
        "t1/bf16/seed0/adopted_from.txt": "/machine/runs/t1/bf16/seed0",
        "t1/bf16/seed1/rl_eval.jsonl": "retrained",
        "t1/bf16/seed1/sft_start.json": "new start",
        "t4/trace_x/seed1/rl_metrics.jsonl": "m",
        "sft/sft_eval.json": "sft",
        "logs/t1_trace_seed0.0.log": "log1",
        "logs/t4_trace_x_seed1.0.log": "log4",
        "logs/sft.log": "sftlog",
        EVENTS_FILE: "events",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    bundle(str(root), str(tmp_path / "b.tgz"))
    dest = tmp_path / "runs"
    (dest / "t1" / "bf16" / "seed0").mkdir(parents=True)
    (dest / "t1" / "bf16" / "seed0" / "rl_eval.jsonl").write_text("old")  # finished earlier
    old_run = dest / "t1" / "bf16" / "seed1"  # trained again on the machine, from a new start
    old_run.mkdir(parents=True)
    for f in ("rl_eval.jsonl", "sft_start.json", "rl_metrics.jsonl"):
        (old_run / f).write_text("old")
    (dest / "t1" / "sft").mkdir()
    (dest / "t1" / "sft" / "sft_eval.json").write_text("sft of earlier runs")
    assert unpack_bundle(str(tmp_path / "b.tgz"), str(dest), "d6") == ["t1", "t4"]
    assert (dest / "t1" / "trace" / "seed0" / "rl_eval.jsonl").read_text() == "new"
    assert (dest / "t1" / "trace" / "seed0" / "sft_start.json").read_text() == "start"
    # An adopted run keeps the results tree's files and leaves no note naming the machine's path.
    assert (dest / "t1" / "bf16" / "seed0" / "rl_eval.jsonl").read_text() == "old"
    assert not (dest / "t1" / "bf16" / "seed0" / "adopted_from.txt").exists()
    # A run trained on the machine replaces every file of the older copy.
    assert sorted(p.name for p in old_run.iterdir()) == ["rl_eval.jsonl", "sft_start.json"]
    assert (old_run / "rl_eval.jsonl").read_text() == "retrained"
    assert (old_run / "sft_start.json").read_text() == "new start"
    assert (dest / "t4" / "trace_x" / "seed1" / "rl_metrics.jsonl").read_text() == "m"
    # A different SFT record goes beside the one already there; an equal one is not repeated.
    assert (dest / "t1" / "sft" / "sft_eval.json").read_text() == "sft of earlier runs"
    assert (dest / "t1" / "sft" / "d6_sft_eval.json").read_text() == "sft"
    assert (dest / "t4" / "sft" / "sft_eval.json").read_text() == "sft"
    assert not (dest / "t4" / "sft" / "d6_sft_eval.json").exists()
    for t in ("t1", "t4"):
        assert (dest / t / "logs" / f"d6_{EVENTS_FILE}").read_text() == "events"
        assert (dest / t / "logs" / "d6_sft.log").read_text() == "sftlog"
    assert (dest / "t1" / "logs" / "d6_t1_trace_seed0.0.log").exists()
    assert not (dest / "t1" / "logs" / "d6_t4_trace_x_seed1.0.log").exists()
    with pytest.raises(ValueError, match="needs a tag"):
        unpack_bundle(str(tmp_path / "b.tgz"), str(dest), "")
