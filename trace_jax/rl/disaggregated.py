"""Rollout and trainer as separate processes, linked only by files in a shared workdir.

  run_trainer(config, workdir)   # in one process (or host)
  run_rollout(config, workdir)   # in another

The paper's disaggregated setting: the rollout engine and the trainer never share memory.
  * policy: the trainer publishes version v (= optimizer steps so far) as an orbax checkpoint
    `policy/<v>`; the rollout process of step t waits for version `(t - lag) * M` (M mini-batches
    per step, `lag` = `config.disaggregated.lag`) and loads it. That handshake is the only way
    parameters travel.
  * rollout batch: the rollout process writes `rollouts/<t>.npz` (tokens, lengths, log-probs,
    masks, expert choices, the version that sampled it) atomically (temp file + rename), once
    every guidance entry of the step is committed.
  * guidance: the rollout process writes each mini-batch's guidance to the tensorstore guidance
    store stamped with its policy version; the trainer reads mini-batch m at its own version
    `t * M + m`, and the store refuses anything more than `max_staleness` versions older.
With lag = 1 the rollout of step t + 1 runs while the trainer trains step t (one step of
staleness; `ExperimentConfig` checks `lag * M + M - 1 <= max_staleness`). With lag = 0 the two
processes reproduce `RLLoop` exactly (same seeds, same batches, same updates). Writes
`rl_metrics.jsonl` (trainer) and `rollout_log.jsonl` (rollout). A run starts from a fresh workdir
(no resume here: `RLLoop` is the resumable single-process loop).
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.metrics_log import MetricsLog
from trace_jax.rl.sharding import experiment_mesh
from trace_jax.rl.workers import RolloutBatch, RolloutWorker, Trainer, init_policy
from trace_jax.rollout import Rollout

ROLLOUT_FIELDS = ("tokens", "prompt_lengths", "lengths", "logprobs", "response_mask")


def _paths(workdir: str) -> dict[str, str]:
    workdir = os.path.abspath(workdir)
    return {name: os.path.join(workdir, name) for name in ("policy", "rollouts", "guidance")}


def wait_for(path: str, what: str, timeout_s: float, poll_s: float = 0.05) -> None:
    """Blocks until `path` exists; TimeoutError naming `what` after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} at {path} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def save_rollout(path: str, batch: RolloutBatch) -> None:
    """The batch without its guidance (that goes through the store), written atomically."""
    roll = batch.rollout
    arrays = {k: np.asarray(getattr(roll, k)) for k in (*ROLLOUT_FIELDS, "expert_choices")}
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, step=batch.step, policy_version=batch.policy_version, **arrays)
    os.replace(tmp, path)


def load_rollout(path: str) -> RolloutBatch:
    """A batch `save_rollout` wrote (device arrays, empty guidance, no reference codes)."""
    with np.load(path) as f:
        roll = Rollout(
            **{k: jax.numpy.asarray(f[k]) for k in (*ROLLOUT_FIELDS, "expert_choices")},
            guidance={},
        )
        return RolloutBatch(int(f["step"]), int(f["policy_version"]), roll)


def publish_rollout(
    store: GuidanceStore, worker: RolloutWorker, batch: RolloutBatch, rollouts_dir: str
) -> None:
    """Rollout -> trainer: the step's guidance into the store, then the batch file
    `<rollouts_dir>/<step>.npz`; the trainer waits for that file, so it is written only once
    every guidance entry of the step is committed."""
    worker.publish_guidance(store, batch)
    store.flush()
    save_rollout(os.path.join(rollouts_dir, f"{batch.step}.npz"), batch)


def policy_manager(workdir: str) -> ocp.CheckpointManager:
    """The published policy versions `<workdir>/policy/<version>`. A few are kept: the rollout
    process reads version (t - lag) * M while the trainer publishes (t + 1) * M, and lag is
    small (bounded by max_staleness)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=4)
    return ocp.CheckpointManager(_paths(workdir)["policy"], options=options)


def publish_policy(manager: ocp.CheckpointManager, model: nnx.Module, version: int) -> None:
    """Saves `model`'s parameters as `version` and waits until they are on disk."""
    manager.save(version, args=ocp.args.StandardSave(nnx.state(model, nnx.Param)))
    manager.wait_until_finished()


def run_rollout(config: ExperimentConfig, workdir: str) -> list[dict]:
    """The rollout process: for each step, wait for its policy version, load it, sample, publish.
    Returns its log rows (`rollout_log.jsonl`): policy version and seconds per phase."""
    lag, timeout_s = config.disaggregated.lag, config.disaggregated.timeout_s
    paths = _paths(workdir)
    os.makedirs(paths["rollouts"], exist_ok=True)
    mesh = experiment_mesh(config.mesh.data, config.mesh.expert)
    worker = RolloutWorker(config, init_policy(config, mesh), config.method_setup(), mesh)
    abstract = nnx.state(worker.model, nnx.Param)
    rows = []
    with (
        policy_manager(workdir) as policies,
        GuidanceStore(GuidanceStoreConfig(kvstore=paths["guidance"])) as store,
        MetricsLog(workdir, "rollout_log") as log,
    ):
        for step in range(config.rl.steps):
            version = max(0, step - lag) * config.rl.grpo.mini_batches
            t0 = time.perf_counter()
            wait_for(os.path.join(paths["policy"], str(version)), "policy", timeout_s)
            policies.reload()
            restored = policies.restore(version, args=ocp.args.StandardRestore(abstract))
            nnx.update(worker.model, restored)
            t1 = time.perf_counter()
            batch = worker.rollout(step, version)  # mismatch statistics: RLLoop only
            t2 = time.perf_counter()
            publish_rollout(store, worker, batch, paths["rollouts"])
            t3 = time.perf_counter()
            row = {
                "policy_version": version,
                "time_wait_policy_s": t1 - t0,
                "time_rollout_s": t2 - t1,
                "time_publish_s": t3 - t2,
            }
            rows.append(log.write(step, row))
    return rows


def run_trainer(config: ExperimentConfig, workdir: str) -> list[dict]:
    """The trainer process: publish version 0, then per step wait for the batch, train, publish
    the new version. Returns its metric rows (`rl_metrics.jsonl`)."""
    paths = _paths(workdir)
    mesh = experiment_mesh(config.mesh.data, config.mesh.expert)
    trainer = Trainer(config, init_policy(config, mesh), config.method_setup(), mesh)
    m = config.rl.grpo.mini_batches
    history = []
    with (
        policy_manager(workdir) as policies,
        GuidanceStore(GuidanceStoreConfig(kvstore=paths["guidance"])) as store,
        MetricsLog(workdir, "rl_metrics") as log,
    ):
        publish_policy(policies, trainer.model, 0)
        for step in range(config.rl.steps):
            t0 = time.perf_counter()
            path = os.path.join(paths["rollouts"], f"{step}.npz")
            wait_for(path, "rollout batch", config.disaggregated.timeout_s)
            batch = load_rollout(path)
            t1 = time.perf_counter()
            metrics, blocked = trainer.train(batch, store)
            t2 = time.perf_counter()
            publish_policy(policies, trainer.model, (step + 1) * m)
            os.remove(path)
            row = {
                **metrics,
                "policy_version": step * m,
                "rollout_policy_version": batch.policy_version,
                "max_staleness_used": step * m + m - 1 - batch.policy_version,
                "time_wait_rollout_s": t1 - t0,
                "time_guidance_io_s": blocked["read"],
                "time_train_s": t2 - t1 - blocked["read"],
            }
            history.append(log.write(step, row))
    return history
