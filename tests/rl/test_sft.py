"""`run_sft`: a few steps, the metrics log, evaluation, the checkpoint round trip, reuse only of
a stage of the same settings."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from trace_jax.models import init_model
from trace_jax.rl.checkpoint import load_params, params_fingerprint
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.sft import (
    FINGERPRINT_KEY,
    evaluate_sft,
    run_sft,
    sft_finished,
    sft_or_reuse,
)
from trace_jax.rl.workdir import WorkdirConfigError


def _config(**sft) -> ExperimentConfig:
    """One block of the tiny model: SFT treats every block alike (a block less is about 40% less
    to compile)."""
    cd = tiny.experiment_config()
    cd.model.n_layers = 1
    cd.sft.update({"steps": 3, "warmup_steps": 1, "log_every": 2, **sft})
    cd.eval.update(problems_per_split=2, splits=("level1", "arith_countdown_l2"), max_new_tokens=8)
    return ExperimentConfig.from_config_dict(cd)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sft")
    return workdir, run_sft(_config(), str(workdir))


def test_sft_logs_evaluates_and_checkpoints_the_trained_policy(sft_run):
    workdir, rows = sft_run
    config = _config()
    assert [r["split"] for r in rows] == ["level1", "arith_countdown_l2"]
    assert all(r["problems"] == 2 for r in rows)
    assert all(0.0 <= r["pass@1_bf16"] <= 1.0 and 0.0 <= r["pass@1_nvfp4"] <= 1.0 for r in rows)
    assert json.loads((workdir / "sft_eval.json").read_text())["rows"] == rows
    # A row every `log_every` steps and at the last step.
    history = read_rows(str(workdir / "sft_metrics.jsonl"))
    assert [h["step"] for h in history] == [0, 2]
    assert all(np.isfinite(h["sft_nll"]) for h in history)
    # The checkpoint holds the trained policy: restored into a fresh model, it is not the
    # initialization and it scores exactly the rows the trained model scored.
    restored = init_model(config.model, seed=123)
    load_params(restored, str(workdir / "sft_checkpoint"))
    # The same values uncommitted, as the run's policy is: arrays read into a placement are
    # committed to it, which would compile the evaluation's two samplers once more.
    params = nnx.state(restored, nnx.Param)
    nnx.update(restored, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params))
    init = init_model(config.model, seed=config.seed)
    a = jax.tree.leaves(nnx.state(restored, nnx.Param))
    b = jax.tree.leaves(nnx.state(init, nnx.Param))
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert evaluate_sft(restored, config, jax.random.key(config.seed + 1)) == rows
    # The recorded fingerprint is the restored policy's, not the initialization's.
    recorded = json.loads((workdir / "sft_eval.json").read_text())[FINGERPRINT_KEY]
    assert recorded == params_fingerprint(restored) != params_fingerprint(init)


def test_a_finished_stage_is_reused(sft_run, monkeypatch):
    workdir, rows = sft_run

    def train_again(*args):
        raise AssertionError("a finished SFT stage was trained again")

    monkeypatch.setattr("trace_jax.rl.sft.run_sft", train_again)
    assert sft_finished(str(workdir))
    assert sft_or_reuse(_config(), str(workdir)) == (rows, 0.0)
    assert sft_or_reuse(_config(log_every=1), str(workdir)) == (rows, 0.0)  # only the logging


def test_a_stage_of_other_settings_is_neither_reused_nor_trained_over(sft_run, tmp_path):
    workdir, _ = sft_run
    log_before = (workdir / "sft_metrics.jsonl").read_text()
    assert json.loads((workdir / "sft_config.json").read_text())["sft.steps"] == 3
    with pytest.raises(WorkdirConfigError, match=r"sft\.steps: 3 -> 4"):
        sft_or_reuse(_config(steps=4), str(workdir))
    with pytest.raises(WorkdirConfigError, match=r"sft\.learning_rate: 0\.003 -> 0\.001"):
        run_sft(_config(learning_rate=1e-3), str(workdir))  # refused before any step
    assert (workdir / "sft_metrics.jsonl").read_text() == log_before
    # A finished stage that recorded no settings cannot be checked: refused too.
    unrecorded = tmp_path / "unrecorded"
    (unrecorded / "sft_checkpoint").mkdir(parents=True)
    (unrecorded / "sft_eval.json").write_text('{"rows": []}')
    with pytest.raises(WorkdirConfigError, match="settings it did not record"):
        sft_or_reuse(_config(), str(unrecorded))
