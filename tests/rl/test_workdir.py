"""Workdir records: each stage records its settings at its first start; a rerun with other
settings is refused naming them, unless the allow-list calls the change safe; `move_aside`."""

from __future__ import annotations

import json
import logging
import os

import pytest

from tests import tiny
from trace_jax.rl.disaggregated import run_trainer
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.workdir import (
    SAFE_CHANGES,
    WorkdirConfigError,
    guard_workdir,
    move_aside,
    recorded_settings,
)


def _config(**sections) -> ExperimentConfig:
    """The tiny test config with `sections`' overrides, e.g. `rl={"method": "fp4_qat"}`."""
    cd = tiny.experiment_config()
    for name, values in sections.items():
        cd[name].update(values)
    return ExperimentConfig.from_config_dict(cd)


def test_the_first_start_records_the_settings_and_an_equal_rerun_passes(tmp_path):
    workdir = tmp_path / "run"
    guard_workdir(str(workdir), "rl", _config(rl={"init_from": "sft/ckpt"}))
    saved = json.loads((workdir / "rl_config.json").read_text())
    assert saved["stage"] == "rl" and saved["rl.method"] == "trace" and saved["seed"] == 0
    assert saved["model.n_layers"] == tiny.N_LAYERS and saved["rl.group_size"] == 4
    assert saved["rl.init_from"] == os.path.abspath("sft/ckpt")  # where it was, wherever we are
    assert saved["tasks.levels"] == [1] and saved["model.dtype"] == "bfloat16"
    assert not any(k.startswith(("sft.", "disaggregated.")) for k in saved)  # not an RL setting
    guard_workdir(str(workdir), "rl", _config(rl={"init_from": "sft/ckpt"}, sft={"steps": 70}))
    assert recorded_settings(str(workdir), "rl") == saved
    assert sorted(p.name for p in workdir.iterdir()) == ["rl_config.json"]  # no temp files


def test_a_rerun_with_other_settings_is_refused_naming_each_change(tmp_path):
    guard_workdir(str(tmp_path), "rl", _config())
    other = _config(rl={"method": "fp4_qat", "learning_rate": 3e-4}, model={"n_layers": 3})
    with pytest.raises(WorkdirConfigError) as refused:
        guard_workdir(str(tmp_path), "rl", other)
    assert refused.value.changes == {
        "model.n_layers": (2, 3),
        "rl.learning_rate": (1e-4, 3e-4),
        "rl.method": ("trace", "fp4_qat"),
    }
    message = str(refused.value)
    assert "rl.method: 'trace' -> 'fp4_qat'" in message and "--fresh" in message
    assert recorded_settings(str(tmp_path), "rl")["rl.method"] == "trace"  # kept


def test_allowed_changes_are_accepted_logged_and_recorded(tmp_path, caplog):
    guard_workdir(str(tmp_path), "rl", _config())
    longer = _config(rl={"steps": 30, "eval_every": 5, "checkpoint_every": 3})
    with caplog.at_level(logging.WARNING, logger="trace_jax.rl.workdir"):
        guard_workdir(str(tmp_path), "rl", longer)
    assert "rl.steps 20 -> 30 accepted: more steps continue the run" in caplog.text
    saved = recorded_settings(str(tmp_path), "rl")
    assert (saved["rl.steps"], saved["rl.eval_every"], saved["rl.checkpoint_every"]) == (30, 5, 3)
    # Fewer steps than recorded, or a safe change together with an unsafe one: refused.
    with pytest.raises(WorkdirConfigError, match=r"rl\.steps: 30 -> 25"):
        guard_workdir(str(tmp_path), "rl", _config(rl={"steps": 25}))
    with pytest.raises(WorkdirConfigError) as refused:
        guard_workdir(str(tmp_path), "rl", _config(rl={"steps": 40, "temperature": 0.5}))
    assert list(refused.value.changes) == ["rl.temperature"]
    assert all(change.reason for change in SAFE_CHANGES.values())


def test_outputs_without_a_record_are_refused(tmp_path):
    """A workdir whose run recorded nothing (made before records existed) cannot be checked."""
    (tmp_path / "rl_metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(WorkdirConfigError, match="made with settings it did not record"):
        guard_workdir(str(tmp_path), "rl", _config())
    guard_workdir(str(tmp_path), "sft", _config())  # another stage's record: its own file


def test_the_disaggregated_runner_refuses_a_workdir_of_another_run_before_any_file(tmp_path):
    """Its record is `rl_config.json` too, with its own stage: an `RLLoop` workdir is refused."""
    guard_workdir(str(tmp_path), "rl", _config())
    with pytest.raises(WorkdirConfigError, match="stage: 'rl' -> 'disaggregated'"):
        run_trainer(_config(), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rl_config.json"]


def test_move_aside_renames_workdirs_only(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    assert move_aside(str(workdir)) is None  # nothing to move
    for n in (1, 2):
        guard_workdir(str(workdir / "sft"), "sft", _config())  # a record one level down
        assert move_aside(str(workdir)) == f"{workdir}.old-{n}"
        assert not workdir.exists()
        assert (tmp_path / f"run.old-{n}" / "sft" / "sft_config.json").exists()
    stranger = tmp_path / "photos"
    stranger.mkdir()
    with pytest.raises(ValueError, match="holds no stage record"):
        move_aside(str(stranger))
    (tmp_path / "link").symlink_to(tmp_path / "run.old-1")
    with pytest.raises(ValueError, match="is not one"):
        move_aside(str(tmp_path / "link"))
    monkeypatch.chdir(tmp_path / "run.old-1" / "sft")
    with pytest.raises(ValueError, match="holds the current directory"):
        move_aside(str(tmp_path / "run.old-1"))
    assert stranger.exists() and (tmp_path / "run.old-1").exists()
