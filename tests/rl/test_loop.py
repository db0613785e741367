"""`RLLoop`: a run killed mid-way and resumed equals an uninterrupted run; guidance passes through
the store version-checked; evaluation, checkpoints, mesh sharding and mismatch statistics."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from tests.rl.rollouts import loop_config_dict
from trace_jax import fp4
from trace_jax.guidance import (
    GuidanceError,
    GuidanceStore,
    GuidanceStoreConfig,
    GuidanceVersionError,
)
from trace_jax.quant import SiteMode
from trace_jax.rl import loop as loop_module
from trace_jax.rl import workers
from trace_jax.rl.checkpoint import checkpoint_manager
from trace_jax.rl.experiment import ExperimentConfig, MeshConfig
from trace_jax.rl.loop import RLLoop
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.sharding import place_batch
from trace_jax.rl.workdir import WorkdirConfigError
from trace_jax.rl.workers import mini_batch_slices, mismatch_metrics, read_guidance

COMPARED = ("reward", "loss", "grad_norm", "train_rollout_gap_mean", "response_length")


def _config(**rl) -> ExperimentConfig:
    """3 steps of 2 prompts x 2 samples on the 1-block tiny model; the final step evaluates one
    split; checkpoints only at step 0 (multiples of 5) unless forced."""
    cd = loop_config_dict(**{"eval_every": 3, "checkpoint_every": 5, **rl})
    cd.eval.update(splits=("level1",), problems_per_split=2, max_new_tokens=8)
    return ExperimentConfig.from_config_dict(cd)


def _rows(path) -> list[dict]:
    return read_rows(str(path), missing_ok=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 3-step run on one device: the reference of the resume and mesh tests."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    return workdir, RLLoop(_config(), str(workdir)).run()


@pytest.mark.xdist_group("uninterrupted_run")  # one worker computes the shared reference run
def test_kill_and_resume_matches_uninterrupted(tmp_path, uninterrupted):
    """A chunk of 2 steps, killed after committing step 2's guidance and logging its rows, then
    resumed: the steps, metrics, evaluation and final parameters equal the uninterrupted run's.
    The chunk's last step and the final step are saved although neither is a multiple of 5."""
    workdir_a, full = uninterrupted
    workdir = tmp_path / "b"
    first = RLLoop(_config(), str(workdir)).run(stop_after=2)
    assert [h["step"] for h in first] == [0, 1]
    assert checkpoint_manager(str(workdir / "rl_checkpoints"), 5).latest_step() == 1
    (run_id,) = [p.name for p in (workdir / "guidance").iterdir()]
    x = jax.random.normal(jax.random.key(0), (2, 16))
    with GuidanceStore(GuidanceStoreConfig(kvstore=str(workdir / "guidance"))) as store:
        site = {"0/k": fp4.make_guidance(fp4.quantize(x, "nvfp4"))}
        store.write(run_id, 2, site, policy_version=2)
        assert store.entries(run_id) == [(2, 0)]
    for name in ("rl_metrics", "rl_eval"):
        with open(workdir / f"{name}.jsonl", "a") as f:
            f.write(json.dumps({"step": 2, "reward": -1.0, "level1": -1.0}) + "\n")
    rest = RLLoop(_config(), str(workdir)).run()
    assert [h["step"] for h in rest] == [2]
    assert checkpoint_manager(str(workdir / "rl_checkpoints"), 5).latest_step() == 2
    logged = _rows(workdir / "rl_metrics.jsonl")
    assert [h["step"] for h in logged] == [0, 1, 2] and logged[2]["reward"] >= 0
    for a, b in zip(full, first + rest, strict=True):
        for k in ("reward", "loss", "grad_norm", "train_rollout_gap_mean"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, err_msg=k)
    # One evaluation, at the final step, equal to the uninterrupted run's.
    (evaluated,) = _rows(workdir / "rl_eval.jsonl")
    assert evaluated == _rows(workdir_a / "rl_eval.jsonl")[0]
    assert evaluated["step"] == 2 and 0 <= evaluated["level1"] <= 1
    assert all(h["guidance_rtn_fallback_rows"] == 0 for h in full)
    assert all("code_mismatch" not in h for h in full)  # mismatch_every = 0
    for h in full:  # guidance I/O: its write, its read and the deletion waited for, each timed
        parts = [h[f"time_guidance_{k}_s"] for k in ("write", "read", "delete_wait")]
        assert parts[0] > 0 and parts[1] > 0 and parts[2] >= 0
        assert sum(parts) == pytest.approx(h["time_guidance_io_s"])
    # Consumed guidance is deleted step by step.
    with GuidanceStore(GuidanceStoreConfig(kvstore=str(workdir / "guidance"))) as store:
        assert store.entries(run_id) == []

    def final_params(workdir):
        with RLLoop(_config(), str(workdir)) as loop:
            assert loop.restore() == 3
            return jax.tree.leaves(nnx.state(loop.model, nnx.Param))

    for x, y in zip(final_params(workdir_a), final_params(workdir), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.xdist_group("uninterrupted_run")
def test_a_finished_run_is_not_resumed_with_another_method(uninterrupted):
    """Rerun in a finished workdir with another method: refused before anything is restored,
    run or logged (it would resume the old method's checkpoint and append to its log)."""
    workdir, _ = uninterrupted
    logged = (workdir / "rl_metrics.jsonl").read_text()
    with pytest.raises(WorkdirConfigError, match=r"rl\.method: 'trace' -> 'fp4_qat'"):
        RLLoop(_config(method="fp4_qat"), str(workdir)).run()
    assert (workdir / "rl_metrics.jsonl").read_text() == logged
    assert json.loads((workdir / "rl_config.json").read_text())["rl.method"] == "trace"


def test_mini_batches_train_stale_versions_through_the_store(tmp_path):
    """With M = 2 mini-batches, each rollout batch makes two optimizer steps; mini-batch m reads
    its own guidance entry, written by policy version v0 = 2 * step, as version v0 + m (1 stale),
    and never falls back to RTN."""
    config = _config(steps=2, mini_batches=2, max_staleness=1, eval_every=0)
    history = RLLoop(config, str(tmp_path / "m")).run()
    assert [h["policy_version"] for h in history] == [0, 2]
    assert all(h["max_staleness_used"] == 1 for h in history)
    assert all(h["guidance_rtn_fallback_rows"] == 0 for h in history)
    assert all(np.isfinite(h["loss"]) for h in history)
    assert checkpoint_manager(str(tmp_path / "m" / "rl_checkpoints"), 1).latest_step() == 1
    assert not (tmp_path / "m" / "rl_eval.jsonl").exists()  # eval_every = 0


def test_nan_loss_stops_the_run_before_its_checkpoint(tmp_path, monkeypatch):
    def nan_step(*args, **kwargs):
        return {"loss": np.float32("nan"), "grad_norm": np.float32(1.0)}

    monkeypatch.setattr(workers, "grpo_step", nan_step)
    loop = RLLoop(_config(), str(tmp_path / "nan"))
    with pytest.raises(FloatingPointError, match="loss is nan at step 0"):
        loop.run()
    assert checkpoint_manager(str(tmp_path / "nan" / "rl_checkpoints"), 5).latest_step() is None
    assert _rows(tmp_path / "nan" / "rl_metrics.jsonl") == []


def test_mini_batches_must_split_the_batch():
    assert mini_batch_slices(8, 2) == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError, match="equal mini-batches"):
        mini_batch_slices(6, 4)


def test_mismatch_steps_log_per_site_code_mismatch(tmp_path, monkeypatch):
    """On a mismatch step the rollout records full codes at every FP4 site; the trainer's codes
    are compared per site. TRACE's guided sites match the rollout far better than its unguided
    ones, which round to nearest as vanilla FP4 QAT does; the run's own guidance is unchanged
    (compact, guided sites only)."""
    trained_on = []

    def no_update(model, optimizer, rollout, *args, **kwargs):
        # The trainer measures before it updates and the run takes one step: the update itself
        # is not needed, which spares compiling a 4-block training step (the GRPO step has its
        # own tests). It records the guidance the update gets.
        trained_on.append(rollout.guidance)
        return {"loss": np.float32(0.0), "grad_norm": np.float32(0.0)}

    monkeypatch.setattr(workers, "grpo_step", no_update)
    cd = tiny.experiment_config()
    # The preset's four blocks: with two, no code flips anywhere (flips build up with depth).
    cd.model.update(n_layers=None, init_std=0.08)  # activations large enough to flip codes
    cd.rl.update(
        steps=1,
        prompts_per_step=2,
        group_size=2,
        learning_rate=1e-2,
        eval_every=0,
        method="trace",
        guided_layers="1,3",  # an unguided layer between guided ones, where codes flip
        mismatch_every=1,
        max_new_tokens=8,
    )
    (row,) = RLLoop(ExperimentConfig.from_config_dict(cd), str(tmp_path)).run()
    n_layers = 4
    keys = [k for k in row if k.startswith("mismatch/")]
    assert {k.split("/")[1] for k in keys} == {str(i) for i in range(n_layers)}
    guided = [k for k in keys if k.split("/")[1] in ("1", "3")]
    unguided = [k for k in keys if k not in guided]
    # Measured: round to nearest flips 0.09-0.26% of layer 2's expert codes (as FP4 QAT's
    # trainer does there), guidance 0 at layer 3 (FP4 QAT: 0.03-0.7%).
    assert sum(row[k] for k in guided) < sum(row[k] for k in unguided)
    assert sum(row[k] for k in unguided if k.startswith("mismatch/2/")) > 0
    assert 0 < row["code_mismatch"] < 0.05 and 0.5 < row["one_apart_fraction"] <= 1
    # The update gets the run's compact guidance of every row at its guided sites, not the full
    # codes recorded for the measurement.
    (trace_guidance,) = trained_on
    assert sorted(trace_guidance) == sorted(k.removeprefix("mismatch/") for k in guided)
    for g in trace_guidance.values():
        assert g.mode is fp4.GuidanceMode.COMPACT and g.payload.shape[0] == 4


def test_mismatch_metrics_only_from_measured_codes():
    """Code mismatch over all sites, weighted by element count; no number at all when the
    trainer quantizes no site (bf16 training, QUADS), not a 0 that was never measured."""
    stats = {
        "1/k": {"mismatch": 0.5, "n_elements": 10, "n_mismatch": 5, "n_one_apart": 4},
        "0/k": {"mismatch": 0.0, "n_elements": 30, "n_mismatch": 0, "n_one_apart": 0},
    }
    assert mismatch_metrics(stats) == {
        "mismatch/0/k": 0.0,
        "mismatch/1/k": 0.5,
        "code_mismatch": 5 / 40,
        "one_apart_fraction": 4 / 5,
    }
    assert mismatch_metrics({}) == {}


@pytest.mark.xdist_group("uninterrupted_run")
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
def test_run_on_a_data_expert_mesh_matches_one_device(tmp_path, uninterrupted):
    """`mesh.data = 4, mesh.expert = 2`: rollout rows split over data, experts over expert; the
    first step's metrics equal the one-device run's, and the experts are split along E. (Only
    the first: after an update, Adam turns reduction-order noise in near-zero gradients into
    lr-sized parameter differences, so later steps agree only loosely.)"""
    config = dataclasses.replace(_config(), mesh=MeshConfig(data=4, expert=2))
    with RLLoop(config, str(tmp_path / "mesh")) as loop:  # the steps one by one
        w = loop.model.layers[0].moe.w_up[...]
        assert w.sharding.spec[0] == "expert" and len(w.sharding.device_set) == 8
        rows = place_batch(np.zeros((4, 3), np.int32), loop.mesh, 4)  # how prompts are placed
        assert rows.sharding.spec[0] == "data" and len(rows.sharding.device_set) == 8
        batch = loop.rollout_step(0)
        got = loop.train_step(batch, loop.publish_guidance(batch))
    want = uninterrupted[1][0]
    for k in COMPARED:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=1e-6, err_msg=k)


def test_read_guidance_waits_for_the_pending_write_and_raises_its_failure():
    x = jax.random.normal(jax.random.key(1), (2, 32))
    site = {"0/k": fp4.make_guidance(fp4.quantize(x, "nvfp4"))}
    release = threading.Event()
    kw = dict(mini_batches=2, max_staleness=1)
    with GuidanceStore.in_memory() as store, concurrent.futures.ThreadPoolExecutor(1) as pool:

        def late_write():  # the entry commits only after the reader has started waiting
            release.wait(5)
            return store.write("r", 3, site, policy_version=6, micro_batch=1)

        pending = pool.submit(late_write)
        threading.Timer(0.2, release.set).start()
        # Trainer version 3 * 2 + 1 = 7 reads guidance of version 6: one version stale.
        got, waited = read_guidance(store, "r", 3, 1, write=pending, **kw)
        np.testing.assert_array_equal(
            np.asarray(got["0/k"].payload), np.asarray(site["0/k"].payload)
        )
        assert waited["write_wait"] >= 0.15 and waited["read"] > 0
        failed = concurrent.futures.Future()
        failed.set_exception(GuidanceError("disk full"))
        with pytest.raises(GuidanceError, match="disk full"):
            read_guidance(store, "r", 3, 1, write=failed, **kw)
        with pytest.raises(GuidanceError):  # no pending write and nothing committed: not found
            read_guidance(store, "r", 4, 0, **kw)
        with pytest.raises(GuidanceVersionError):  # version 6 is 4 behind trainer version 10
            read_guidance(store, "r", 3, 1, mini_batches=3, max_staleness=1)


@pytest.mark.parametrize(
    "method, in_bf16_too, modes",
    [
        ("fp4_qat", True, [SiteMode.RTN, SiteMode.OFF]),
        ("fp4_qat", False, [SiteMode.RTN]),
        ("bf16", True, [SiteMode.OFF]),  # its own execution is bf16 already
    ],
)
def test_evaluation_scores_fp4_policies_in_bf16_too(
    tmp_path, monkeypatch, method, in_bf16_too, modes
):
    """`eval.in_bf16_too`: an FP4 method's evaluation also scores its policy run in bf16, on the
    same keys, logged as `<split>@bf16` beside its FP4 score."""
    calls = []

    def scores(model, suite, keys, *, qcfg=None, mode=SiteMode.OFF, **kwargs):
        calls.append((mode, [jax.random.key_data(k).tolist() for k in keys]))
        return {s: 0.25 if mode is SiteMode.OFF else 0.5 for s in suite.splits}

    monkeypatch.setattr(loop_module, "pass_at_1_by_split", scores)
    cd = loop_config_dict(method=method)
    cd.eval.update(splits=("level1",), problems_per_split=2, in_bf16_too=in_bf16_too)
    with RLLoop(ExperimentConfig.from_config_dict(cd), str(tmp_path)) as loop:
        row = loop.evaluate(4)
    assert [m for m, _ in calls] == modes
    assert all(k == calls[0][1] for _, k in calls)
    own = 0.25 if method == "bf16" else 0.5
    want = {"step": 4, "level1": own, **({"level1@bf16": 0.25} if len(modes) == 2 else {})}
    assert row == want and _rows(tmp_path / "rl_eval.jsonl") == [want]
