"""Rollout and trainer as two processes linked only by the workdir (policy checkpoints, rollout
batches, the guidance store) reproduce the single-process loop; a lagging rollout trains stale
guidance within max_staleness."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import disaggregated
from experiments import main as rl_main
from tests import tiny

OVERRIDES = dict(
    prompts_per_step=2,
    group_size=2,
    max_new_tokens=8,
    eval_every=0,
    learning_rate=1e-2,
    mismatch_every=0,
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(steps):
    cfg = tiny.experiment_config()
    cfg.rl.update(steps=steps, **OVERRIDES)
    return cfg


def _run_both(workdir, steps, lag):
    flags = [f"--config.rl.{k}={v}" for k, v in {**OVERRIDES, "steps": steps}.items()]
    cmd = [
        sys.executable,
        "-m",
        "experiments.disaggregated",
        "--config=configs/tiny_cpu.py",
        f"--config.model.n_layers={tiny.N_LAYERS}",
        f"--workdir={workdir}",
        f"--lag={lag}",
        "--timeout_s=300",
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    def rows(name):
        return [json.loads(x) for x in open(os.path.join(workdir, name)).read().splitlines()]

    return rows("rl_metrics.jsonl"), rows("rollout_log.jsonl")


def test_two_processes_reproduce_the_single_process_loop(tmp_path):
    trainer, rollout = _run_both(str(tmp_path / "dis"), steps=2, lag=0)
    single = rl_main.run(_cfg(2), str(tmp_path / "one"))
    assert [r["step"] for r in trainer] == [0, 1]
    assert [r["policy_version"] for r in rollout] == [0, 1]
    for a, b in zip(single, trainer, strict=True):
        for k in ("reward", "loss", "grad_norm", "train_rollout_gap_mean", "response_length"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, err_msg=k)
        assert b["guidance_rtn_fallback_rows"] == 0 and b["max_staleness_used"] == 0
    # Every rollout batch was consumed and every guidance entry garbage-collected.
    assert not os.listdir(tmp_path / "dis" / "rollouts")


def test_lagging_rollout_trains_stale_guidance(tmp_path):
    trainer, rollout = _run_both(str(tmp_path / "lag"), steps=3, lag=1)
    assert [r["policy_version"] for r in rollout] == [0, 0, 1]
    assert [r["rollout_policy_version"] for r in trainer] == [0, 0, 1]
    assert [r["max_staleness_used"] for r in trainer] == [0, 1, 1]
    assert all(r["guidance_rtn_fallback_rows"] == 0 for r in trainer)
    assert all(np.isfinite(r["loss"]) for r in trainer)


def test_staleness_bound_and_rollout_files(tmp_path):
    cfg = _cfg(2)
    cfg.rl.update(mini_batches=2, max_staleness=2)
    disaggregated.check_staleness(cfg, 0)  # worst 1
    with pytest.raises(ValueError, match="3 versions stale; max_staleness is 2"):
        disaggregated.check_staleness(cfg, 1)
    parts = rl_main.prepare(_cfg(1))
    roll, _ = rl_main.rollout_step(parts, 0)
    path = str(tmp_path / "r.npz")
    disaggregated.save_rollout(path, roll, version=7)
    back, version = disaggregated.load_rollout(path)
    assert version == 7 and back.guidance == {}
    for k in ("tokens", "lengths", "logprobs", "response_mask", "expert_choices"):
        np.testing.assert_array_equal(np.asarray(getattr(back, k)), np.asarray(getattr(roll, k)))


def test_rollout_batch_is_published_after_its_guidance_commits(tmp_path, monkeypatch):
    import time
    import types

    import jax

    from trace_jax import fp4
    from trace_jax.guidance import GuidanceStore

    cfg = _cfg(1)
    cfg.rl.mini_batches = 2
    parts = types.SimpleNamespace(
        cfg=cfg, run_id="r", setup=types.SimpleNamespace(capture=("0/k",))
    )
    site = {
        "0/k": fp4.make_guidance(
            fp4.quantize(jax.random.normal(jax.random.key(0), (2, 32)), "nvfp4")
        )
    }
    roll = types.SimpleNamespace(
        tokens=np.zeros((4, 3)), rows=lambda rows: types.SimpleNamespace(guidance=site)
    )
    store = GuidanceStore.in_memory()
    slow = store._write

    def slow_write(*a):  # commits well after write_async returned
        time.sleep(0.3)
        return slow(*a)

    monkeypatch.setattr(store, "_write", slow_write)
    published = []
    monkeypatch.setattr(
        disaggregated,
        "save_rollout",
        lambda path, r, version: published.append((os.path.basename(path), store.entries("r"))),
    )
    with store:
        disaggregated.publish_rollout(store, parts, roll, 5, 10, str(tmp_path))
    assert published == [("5.npz", [(5, 0), (5, 1)])]  # both entries committed before the batch
