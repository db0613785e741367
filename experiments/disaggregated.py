r"""Rollout and training as separate processes, linked only by files in a shared workdir.

  python -m experiments.disaggregated --config=configs/tiny_cpu.py --workdir=/tmp/trace_dis \
      --role=both            # or run --role=rollout and --role=trainer in two shells / hosts

The paper's disaggregated setting: the rollout engine and the trainer never share memory.
  * policy: the trainer publishes version v (= optimizer steps so far) as an orbax checkpoint
    `policy/<v>`; the rollout process of step t waits for version `(t - lag) * M` (M mini-batches
    per step) and loads it. That handshake is the only way parameters travel.
  * rollout batch: the rollout process writes `rollouts/<t>.npz` (tokens, lengths, log-probs,
    masks, expert choices, the version that sampled it) atomically (temp file + rename).
  * guidance: the rollout process writes each mini-batch's guidance to the tensorstore guidance
    store stamped with its policy version; the trainer reads mini-batch m at its own version
    `t * M + m`, and the store refuses anything more than `max_staleness` versions older.
With `lag` = 1 the rollout of step t + 1 runs while the trainer trains step t (one step of
staleness: lag * M + M - 1 <= max_staleness is checked up front). With lag = 0 the two processes
reproduce `experiments.main` exactly (same seeds, same batches, same updates).
Writes `rl_metrics.jsonl` (trainer) and `rollout_log.jsonl` (rollout) to --workdir. A run starts
from a fresh workdir (no resume here: `experiments.main` is the resumable single-process loop).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from experiments import main as rl_main
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig
from trace_jax.rl.metrics_log import MetricsLog
from trace_jax.rollout import Rollout

_ROLLOUT_FIELDS = ("tokens", "prompt_lengths", "lengths", "logprobs", "response_mask")


def _paths(workdir: str) -> dict[str, str]:
    workdir = os.path.abspath(workdir)
    return {
        "policy": os.path.join(workdir, "policy"),
        "rollouts": os.path.join(workdir, "rollouts"),
        "guidance": os.path.join(workdir, "guidance"),
    }


def _wait_for(path: str, what: str, timeout_s: float, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} at {path} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def check_staleness(cfg, lag: int) -> None:
    """The stalest mini-batch is `lag * M + M - 1` versions behind its trainer."""
    rl = cfg.rl
    worst = lag * rl.mini_batches + rl.mini_batches - 1
    limit = rl.get("max_staleness", rl_main.GRPOConfig.max_staleness)
    if lag < 0 or worst > limit:
        raise ValueError(
            f"lag={lag} with {rl.mini_batches} mini-batches trains guidance {worst} versions "
            f"stale; max_staleness is {limit}"
        )


def save_rollout(path: str, roll: Rollout, version: int) -> None:
    """The rollout batch without its guidance (that goes through the store), atomically."""
    arrays = {k: np.asarray(getattr(roll, k)) for k in _ROLLOUT_FIELDS}
    arrays["expert_choices"] = np.asarray(roll.expert_choices)
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, policy_version=version, **arrays)
    os.replace(tmp, path)


def publish_rollout(
    store: GuidanceStore, parts, roll: Rollout, step: int, version: int, rollouts_dir: str
) -> None:
    """Rollout -> trainer: the step's guidance into the store, then the batch file
    `<rollouts_dir>/<step>.npz`; the trainer waits for that file, so it is written only once
    every guidance entry of the step is committed."""
    rl_main.write_guidance(store, parts, roll, step, version)
    store.flush()
    save_rollout(os.path.join(rollouts_dir, f"{step}.npz"), roll, version)


def load_rollout(path: str) -> tuple[Rollout, int]:
    with np.load(path) as f:
        roll = Rollout(
            **{k: jax.numpy.asarray(f[k]) for k in (*_ROLLOUT_FIELDS, "expert_choices")},
            guidance={},
        )
        return roll, int(f["policy_version"])


def _policies(paths: dict[str, str]) -> ocp.CheckpointManager:
    # A few versions are kept: the rollout process reads version (t - lag) * M while the trainer
    # publishes (t + 1) * M, and lag is small (bounded by max_staleness).
    return ocp.CheckpointManager(
        paths["policy"], options=ocp.CheckpointManagerOptions(max_to_keep=4)
    )


def _publish_policy(mngr: ocp.CheckpointManager, model, version: int) -> None:
    mngr.save(version, args=ocp.args.StandardSave(nnx.state(model, nnx.Param)))
    mngr.wait_until_finished()


def run_rollout(cfg, workdir: str, *, lag: int = 0, timeout_s: float = 600.0) -> list[dict]:
    """The rollout process: for each step, wait for its policy version, sample, publish."""
    check_staleness(cfg, lag)
    paths = _paths(workdir)
    os.makedirs(paths["rollouts"], exist_ok=True)
    parts = rl_main.prepare(cfg)
    policies = _policies(paths)
    store = GuidanceStore(GuidanceStoreConfig(kvstore=paths["guidance"]))
    abstract = nnx.state(parts.model, nnx.Param)
    rows = []
    with MetricsLog(workdir, "rollout_log") as log, store:
        for step in range(cfg.rl.steps):
            version = max(0, step - lag) * cfg.rl.mini_batches
            t0 = time.perf_counter()
            _wait_for(os.path.join(paths["policy"], str(version)), "policy", timeout_s)
            policies.reload()
            restored = policies.restore(version, args=ocp.args.StandardRestore(abstract))
            nnx.update(parts.model, restored)
            t1 = time.perf_counter()
            roll, _ = rl_main.rollout_step(parts, step)  # mismatch stats: experiments.main only
            t2 = time.perf_counter()
            publish_rollout(store, parts, roll, step, version, paths["rollouts"])
            t3 = time.perf_counter()
            rows.append(
                log.write(
                    step,
                    {
                        "policy_version": version,
                        "time_wait_policy_s": t1 - t0,
                        "time_rollout_s": t2 - t1,
                        "time_publish_s": t3 - t2,
                    },
                )
            )
    return rows


def run_trainer(cfg, workdir: str, *, timeout_s: float = 600.0) -> list[dict]:
    """The trainer process: publish version 0, then per step read the batch and train."""
    paths = _paths(workdir)
    parts = rl_main.prepare(cfg)
    policies = _policies(paths)
    _publish_policy(policies, parts.model, 0)
    store = GuidanceStore(GuidanceStoreConfig(kvstore=paths["guidance"]))
    m = cfg.rl.mini_batches
    history = []
    with MetricsLog(workdir, "rl_metrics") as log, store:
        for step in range(cfg.rl.steps):
            t0 = time.perf_counter()
            path = os.path.join(paths["rollouts"], f"{step}.npz")
            _wait_for(path, "rollout batch", timeout_s)
            roll, sampled_by = load_rollout(path)
            t1 = time.perf_counter()
            metrics, blocked = rl_main.train_step(parts, store, roll, step)
            t_read = blocked["read"]
            t2 = time.perf_counter()
            _publish_policy(policies, parts.model, (step + 1) * m)
            if parts.setup.capture:
                store.gc(parts.run_id, step)
            os.remove(path)
            row = {
                **metrics,
                "policy_version": step * m,
                "rollout_policy_version": sampled_by,
                "max_staleness_used": step * m + m - 1 - sampled_by,
                "time_wait_rollout_s": t1 - t0,
                "time_guidance_io_s": t_read,
                "time_train_s": t2 - t1 - t_read,
            }
            history.append(log.write(step, row))
            logging.info("trainer step %d: %s", step, row)
    return history


def define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "ml_collections config file", lock_config=True)
    flags.DEFINE_string("workdir", "workdir/disaggregated", "shared by the two processes")
    flags.DEFINE_enum("role", "both", ["rollout", "trainer", "both"], "which process this is")
    flags.DEFINE_integer("lag", 0, "policy versions (in steps) the rollout may run ahead")
    flags.DEFINE_float("timeout_s", 600.0, "how long a process waits for the other")
    flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    f = flags.FLAGS
    if f.role == "rollout":
        run_rollout(f.config, f.workdir, lag=f.lag, timeout_s=f.timeout_s)
    elif f.role == "trainer":
        run_trainer(f.config, f.workdir, timeout_s=f.timeout_s)
    else:  # both: this process starts the two roles as children with the same flags
        check_staleness(f.config, f.lag)
        args = [a for a in sys.argv[1:] if not a.startswith("--role")]
        cmd = [sys.executable, "-m", "experiments.disaggregated", *args]
        procs = [subprocess.Popen([*cmd, f"--role={role}"]) for role in ("trainer", "rollout")]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a process failed: exit codes (trainer, rollout) = {codes}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
