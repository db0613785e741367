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
`rl_metrics.jsonl` (trainer) and `rollout_log.jsonl` (rollout).

The two watch each other: each writes a heartbeat `heartbeats/<role>.json` (pid, host, role,
step, time) every second and, when it ends, an exit marker in the same file. A process waiting
for the other's next file exits with `PartnerGoneError` (naming the partner, its last step and
how long ago it was seen) once the partner's heartbeat is unchanged for
`config.disaggregated.heartbeat_timeout_s` or says it exited, instead of waiting `timeout_s`.

A run starts from a fresh workdir: the trainer keeps no optimizer state, so nothing here can
resume (`RLLoop` is the resumable single-process loop); each process refuses, before any work, a
workdir where its role ran before (`refuse_reused_workdir`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig
from trace_jax.rl.checkpoint import restore_step, save_step
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.metrics_log import MetricsLog
from trace_jax.rl.sharding import experiment_mesh
from trace_jax.rl.workdir import guard_workdir
from trace_jax.rl.workers import RolloutBatch, RolloutWorker, Trainer, init_policy
from trace_jax.rollout import Rollout

ROLLOUT_FIELDS = ("tokens", "prompt_lengths", "lengths", "logprobs", "response_mask")
ROLES = ("trainer", "rollout")
PARTNER = {"trainer": "rollout", "rollout": "trainer"}
ROLE_LOGS = {"trainer": "rl_metrics", "rollout": "rollout_log"}
HEARTBEATS = "heartbeats"

log = logging.getLogger(__name__)


def _paths(workdir: str) -> dict[str, str]:
    workdir = os.path.abspath(workdir)
    return {name: os.path.join(workdir, name) for name in ("policy", "rollouts", "guidance")}


class PartnerGoneError(RuntimeError):
    """The other process of a disaggregated run stopped: its heartbeat went stale or it
    exited."""


class WorkdirReusedError(FileExistsError):
    """The workdir holds an earlier run of a role (`refuse_reused_workdir`)."""


def heartbeat_path(workdir: str, role: str) -> str:
    return os.path.join(os.path.abspath(workdir), HEARTBEATS, f"{role}.json")


def read_heartbeat(path: str) -> dict | None:
    """The record at `path` (None if there is none yet)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class Heartbeat:
    """This process's sign of life for its partner, as a context manager.

    `heartbeat_path(workdir, role)` holds `{"pid", "host", "role", "step", "time"}`, rewritten
    atomically every `interval_s` by a daemon thread (so a killed process stops beating); on
    exit the record gets `"exit": "finished"` or `"exit": "failed"` and `"error"`. The loop
    sets `step` as it goes.
    """

    def __init__(self, workdir: str, role: str, interval_s: float = 1.0):
        self.path, self.role, self.interval_s = heartbeat_path(workdir, role), role, interval_s
        self.step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{role}", daemon=True)

    def write(self, **extra) -> None:
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "role": self.role,
            "step": self.step,
            "time": time.time(),
            **extra,
        }
        tmp = f"{self.path}.tmp.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write()
            except OSError as e:  # a missed beat; the partner gives up only after several
                log.warning("heartbeat %s not written: %s", self.path, e)

    def __enter__(self) -> Heartbeat:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.write()
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self.write(exit="finished")
        else:
            self.write(exit="failed", error=f"{exc_type.__name__}: {exc}")


class PartnerWatch:
    """Watches the partner's heartbeat (`role`'s, in `workdir`): `check` raises
    PartnerGoneError once it exited or its record has not changed for `timeout_s`.

    A partner on this host is stale when its record's time is `timeout_s` old; one on another
    host when this process has seen the same record for `timeout_s` (the hosts' clocks may
    differ). A partner without a heartbeat yet is still starting.
    """

    def __init__(self, workdir: str, role: str, timeout_s: float):
        self.path, self.role, self.timeout_s = heartbeat_path(workdir, role), role, timeout_s
        self._record: dict | None = None
        self._first_seen = time.monotonic()
        self._host = socket.gethostname()

    def started(self) -> bool:
        return os.path.exists(self.path)

    def check(self, waiting_for: str) -> None:
        """Raises PartnerGoneError (saying this process was waiting for `waiting_for`) if the
        partner is gone."""
        try:
            record = read_heartbeat(self.path)
        except (OSError, ValueError):  # unreadable now (a file system hiccup): judge it later
            return
        now = time.monotonic()
        if record is None:
            return
        if record != self._record:
            self._record, self._first_seen = record, now
        who = f"the {self.role} (pid {record['pid']} on {record['host']})"
        step = record.get("step")
        step = "start-up" if step is None else f"step {step}"
        ago = time.time() - record["time"]
        silent = ago if record["host"] == self._host else now - self._first_seen
        if record.get("exit") == "failed":
            why = f"{who} failed at {step}, {ago:.1f} s ago: {record.get('error')}"
        elif record.get("exit"):
            why = f"{who} finished at {step}, {ago:.1f} s ago"
        elif silent > self.timeout_s:
            why = (
                f"{who} is gone: its heartbeat {self.path} has not changed for {silent:.1f} s "
                f"(heartbeat_timeout_s={self.timeout_s:g}); last seen at {step}"
            )
        else:
            return
        raise PartnerGoneError(f"{why}; stopped waiting for {waiting_for}")


def wait_for(
    path: str,
    what: str,
    timeout_s: float,
    poll_s: float = 0.05,
    partner: PartnerWatch | None = None,
) -> None:
    """Blocks until `path` exists; TimeoutError naming `what` after `timeout_s` seconds, or
    PartnerGoneError as soon as `partner` (the process that writes `path`) is gone."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if partner is not None:
            try:
                partner.check(f"the {what} at {path}")
            except PartnerGoneError:
                if os.path.exists(path):  # written just before the partner ended
                    return
                raise
        if time.monotonic() > deadline:
            never = "" if partner is None or partner.started() else f" (no {partner.role} started)"
            raise TimeoutError(f"no {what} at {path} after {timeout_s:.0f} s{never}")
        time.sleep(poll_s)


def refuse_reused_workdir(workdir: str, roles: tuple[str, ...] = ROLES) -> None:
    """Raises WorkdirReusedError, before any work, when `workdir` holds what an earlier run of one
    of `roles` wrote (its heartbeat or its log): nothing here resumes, and the guidance store
    and the policy versions would refuse or mix that run's entries minutes later."""
    for role in roles:
        found = [
            p
            for p in (
                heartbeat_path(workdir, role),
                os.path.join(os.path.abspath(workdir), f"{ROLE_LOGS[role]}.jsonl"),
            )
            if os.path.exists(p)
        ]
        if not found:
            continue
        record = read_heartbeat(heartbeat_path(workdir, role))
        seen = ""
        if record is not None:
            state = record.get("exit") or "no exit marker"
            seen = (
                f"; its heartbeat: pid {record['pid']} on {record['host']}, step "
                f"{record.get('step')}, {state}, {time.time() - record['time']:.0f} s ago"
            )
        raise WorkdirReusedError(
            f"{workdir} holds an earlier {role} run ({', '.join(found)}{seen}); the "
            "disaggregated runner cannot resume (it keeps no optimizer state): start fresh "
            "(--fresh: `trace_jax.rl.workdir.move_aside`) or use another workdir"
        )


def _watching(config: ExperimentConfig, workdir: str, role: str) -> tuple[Heartbeat, PartnerWatch]:
    """This role's heartbeat (beating a few times per `heartbeat_timeout_s`) and the watch of
    its partner."""
    timeout_s = config.disaggregated.heartbeat_timeout_s
    return (
        Heartbeat(workdir, role, interval_s=min(1.0, timeout_s / 4)),
        PartnerWatch(workdir, PARTNER[role], timeout_s),
    )


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
    """Saves `model`'s parameters as `version`, with their checksums (the rollout process
    verifies what it loads: `trace_jax.rl.checkpoint`), and waits until they are on disk."""
    save_step(manager, version, nnx.state(model, nnx.Param), force=True)
    manager.wait_until_finished()


def run_rollout(config: ExperimentConfig, workdir: str) -> list[dict]:
    """The rollout process: for each step, wait for its policy version, load it, sample, publish.
    Returns its log rows (`rollout_log.jsonl`): policy version and seconds per phase."""
    refuse_reused_workdir(workdir, ("rollout",))
    guard_workdir(workdir, "disaggregated", config)  # a workdir of other settings is refused
    beat, partner = _watching(config, workdir, "rollout")
    with beat:  # from here on the trainer sees this process alive, or how it ended
        return _rollout_steps(config, workdir, beat, partner)


def _rollout_steps(
    config: ExperimentConfig, workdir: str, beat: Heartbeat, partner: PartnerWatch
) -> list[dict]:
    lag, timeout_s = config.disaggregated.lag, config.disaggregated.timeout_s
    paths = _paths(workdir)
    os.makedirs(paths["rollouts"], exist_ok=True)
    mesh = experiment_mesh(config.mesh.data, config.mesh.expert, config.mesh.fsdp)
    worker = RolloutWorker(config, init_policy(config, mesh), config.method_setup(), mesh)
    abstract = nnx.state(worker.model, nnx.Param)
    rows = []
    with (
        policy_manager(workdir) as policies,
        GuidanceStore(GuidanceStoreConfig(kvstore=paths["guidance"])) as store,
        MetricsLog(workdir, "rollout_log") as rollout_log,
    ):
        for step in range(config.rl.steps):
            beat.step = step
            version = max(0, step - lag) * config.rl.grpo.mini_batches
            t0 = time.perf_counter()
            policy = os.path.join(paths["policy"], str(version))
            wait_for(policy, f"policy version {version}", timeout_s, partner=partner)
            policies.reload()
            nnx.update(worker.model, restore_step(policies, version, abstract))
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
            rows.append(rollout_log.write(step, row))
    return rows


def run_trainer(config: ExperimentConfig, workdir: str) -> list[dict]:
    """The trainer process: publish version 0, then per step wait for the batch, train, publish
    the new version. Returns its metric rows (`rl_metrics.jsonl`)."""
    refuse_reused_workdir(workdir, ("trainer",))
    guard_workdir(workdir, "disaggregated", config)  # a workdir of other settings is refused
    beat, partner = _watching(config, workdir, "trainer")
    with beat:  # from here on the rollout process sees this one alive, or how it ended
        return _trainer_steps(config, workdir, beat, partner)


def _trainer_steps(
    config: ExperimentConfig, workdir: str, beat: Heartbeat, partner: PartnerWatch
) -> list[dict]:
    paths = _paths(workdir)
    mesh = experiment_mesh(config.mesh.data, config.mesh.expert, config.mesh.fsdp)
    trainer = Trainer(config, init_policy(config, mesh), config.method_setup(), mesh)
    m, timeout_s = config.rl.grpo.mini_batches, config.disaggregated.timeout_s
    history = []
    with (
        policy_manager(workdir) as policies,
        GuidanceStore(GuidanceStoreConfig(kvstore=paths["guidance"])) as store,
        MetricsLog(workdir, "rl_metrics") as metrics_log,
    ):
        publish_policy(policies, trainer.model, 0)
        for step in range(config.rl.steps):
            beat.step = step
            t0 = time.perf_counter()
            path = os.path.join(paths["rollouts"], f"{step}.npz")
            wait_for(path, f"rollout batch of step {step}", timeout_s, partner=partner)
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
            history.append(metrics_log.write(step, row))
    trainer.close()  # the last step's background deletion: its failure raises here
    return history
