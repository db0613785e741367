"""Rollout and trainer as separate processes, linked only by an exchange location.

  run_trainer(config, workdir)   # in one process (or host)
  run_rollout(config, workdir)   # in another

The paper's disaggregated setting: the rollout engine and the trainer never share memory, nor
need a shared disk. Everything they pass goes through the exchange (`trace_jax.rl.exchange`):
`config.disaggregated.exchange`, a kvstore URL ("s3://bucket/prefix/" with the
`disaggregated.exchange_s3_*` settings, "gs://bucket/prefix/", "file:///dir/") or a directory;
"" is the workdir, which the two processes then share.
  * policy: the trainer publishes version v (= optimizer steps so far) as a bundle `policy/<v>/`
    (one object per parameter, crc32 each), written on a thread of its own behind the trainer's
    next step; the rollout process of step t waits for version `(t - lag) * M` (M mini-batches
    per step, `lag` = `config.disaggregated.lag`) and loads it, verified, read on a thread of its
    own behind the rollout of the step before (`trace_jax.rl.policy_bundles`). That handshake is
    the only way parameters travel; the newest `lag + 2` are kept.
  * rollout batch: the rollout process commits the bundle `rollouts/<t>/` (tokens, lengths,
    log-probs, masks, expert choices, the version that sampled it), once every guidance entry of
    the step is committed; the trainer deletes it once trained.
  * guidance: the rollout process writes each mini-batch's guidance to the guidance store under
    `guidance/`, stamped with its policy version; the trainer reads mini-batch m at its own
    version `t * M + m`, and the store refuses anything more than `max_staleness` versions older.
With lag = 1 the rollout of step t + 1 runs while the trainer trains step t (one step of
staleness; `ExperimentConfig` checks `lag * M + M - 1 <= max_staleness`). With lag = 0 the two
processes reproduce `RLLoop` exactly (same seeds, same batches, same updates). Each writes its
own log into its own workdir: `rl_metrics.jsonl` (trainer), `rollout_log.jsonl` (rollout).

The two watch each other: each writes a heartbeat record `heartbeats/<role>.json` (pid, host,
role, step, time) into the exchange every second and, when it ends, an exit marker in the same
record. A process waiting for the other's next object exits with `PartnerGoneError` (naming the
partner, its last step and how long ago it was seen) once the partner's heartbeat is unchanged
for `config.disaggregated.heartbeat_timeout_s` or says it exited, instead of waiting `timeout_s`.

A run starts afresh: the trainer keeps no optimizer state, so nothing here can resume (`RLLoop`
is the resumable single-process loop); each process refuses, before any work, a workdir where
its role logged or an exchange where its role beat before (`refuse_reused_workdir`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.guidance import GuidanceStore
from trace_jax.rl.exchange import Exchange, ExchangeCorruptError, ExchangeError, manifest_key
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.metrics_log import MetricsLog
from trace_jax.rl.policy_bundles import (
    PolicyPrefetcher,
    PolicyPublisher,
    policy_prefix,
    publish_policy,
)
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


class PartnerGoneError(RuntimeError):
    """The other process of a disaggregated run stopped: its heartbeat went stale or it
    exited."""


class WaitStoppedError(RuntimeError):
    """A wait for the partner's object was stopped by its owner (`wait_for(stop=...)`)."""


class WorkdirReusedError(FileExistsError):
    """The workdir or the exchange holds an earlier run of a role (`refuse_reused_workdir`)."""


def run_exchange(config: ExperimentConfig, workdir: str) -> Exchange:
    """The exchange of a run: `config.disaggregated.exchange`, or `workdir` when ""."""
    d = config.disaggregated
    return Exchange.at(
        d.exchange or os.path.abspath(workdir),
        s3_endpoint=d.exchange_s3_endpoint,
        s3_region=d.exchange_s3_region,
        s3_credentials=d.exchange_s3_credentials,
    )


def rollout_prefix(step: int) -> str:
    return f"rollouts/{step}/"


def heartbeat_key(role: str) -> str:
    return f"{HEARTBEATS}/{role}.json"


def heartbeat_path(workdir: str, role: str) -> str:
    """The file of `role`'s heartbeat when the exchange is the workdir."""
    return os.path.join(os.path.abspath(workdir), heartbeat_key(role))


def read_heartbeat(exchange: Exchange, role: str) -> dict | None:
    """`role`'s heartbeat record (None if there is none yet)."""
    return exchange.read_json(heartbeat_key(role))


class Heartbeat:
    """This process's sign of life for its partner, as a context manager.

    The record `heartbeat_key(role)` of `exchange` holds `{"pid", "host", "role", "step",
    "time"}`, rewritten every `interval_s` by a daemon thread (so a killed process stops
    beating); on exit it gets `"exit": "finished"` or `"exit": "failed"` and `"error"`. The loop
    sets `step` as it goes.
    """

    def __init__(self, exchange: Exchange, role: str, interval_s: float = 1.0):
        self.exchange, self.role, self.interval_s = exchange, role, interval_s
        self.key = heartbeat_key(role)
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
        self.exchange.write_json(self.key, record)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write()
            except ExchangeError as e:  # a missed beat; the partner gives up only after several
                log.warning("heartbeat %s not written: %s", self.exchange.where(self.key), e)

    def __enter__(self) -> Heartbeat:
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
    """Watches the heartbeat of `role` in `exchange`: `check` raises PartnerGoneError once it
    exited or its record has not changed for `timeout_s`.

    A partner on this host is stale when its record's time is `timeout_s` old; one on another
    host when this process has seen the same record for `timeout_s` (the hosts' clocks may
    differ). A partner without a heartbeat yet is still starting.
    """

    def __init__(self, exchange: Exchange, role: str, timeout_s: float):
        self.exchange, self.role, self.timeout_s = exchange, role, timeout_s
        self.key = heartbeat_key(role)
        self._record: dict | None = None
        self._first_seen = time.monotonic()
        self._host = socket.gethostname()

    def started(self) -> bool:
        return self.exchange.exists(self.key)

    def check(self, waiting_for: str) -> None:
        """Raises PartnerGoneError (saying this process was waiting for `waiting_for`) if the
        partner is gone."""
        try:
            record = self.exchange.read_json(self.key)
        except ExchangeError:  # unreadable now (a storage hiccup): judge it later
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
                f"{who} is gone: its heartbeat {self.exchange.where(self.key)} has not changed "
                f"for {silent:.1f} s (heartbeat_timeout_s={self.timeout_s:g}); last seen at {step}"
            )
        else:
            return
        raise PartnerGoneError(f"{why}; stopped waiting for {waiting_for}")


def wait_for(
    exchange: Exchange,
    key: str,
    what: str,
    timeout_s: float,
    poll_s: float = 0.05,
    partner: PartnerWatch | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Blocks until `key` exists in `exchange`; TimeoutError naming `what` after `timeout_s`
    seconds, PartnerGoneError as soon as `partner` (the process that writes `key`) is gone,
    WaitStoppedError once `stop` is set (the waiter's owner closes)."""
    deadline = time.monotonic() + timeout_s
    where = exchange.where(key)
    while not exchange.exists(key):
        if stop is not None and stop.is_set():
            raise WaitStoppedError(f"stopped waiting for the {what} at {where}")
        if partner is not None:
            try:
                partner.check(f"the {what} at {where}")
            except PartnerGoneError:
                if exchange.exists(key):  # written just before the partner ended
                    return
                raise
        if time.monotonic() > deadline:
            never = "" if partner is None or partner.started() else f" (no {partner.role} started)"
            raise TimeoutError(f"no {what} at {where} after {timeout_s:.0f} s{never}")
        time.sleep(poll_s)


def refuse_reused_workdir(
    workdir: str, roles: tuple[str, ...] = ROLES, exchange: Exchange | None = None
) -> None:
    """Raises WorkdirReusedError, before any work, when an earlier run of one of `roles` left
    its log in `workdir` or its heartbeat in `exchange` (None: the workdir's): nothing here
    resumes, and the guidance store and the policy versions would refuse or mix that run's
    objects minutes later."""
    exchange = exchange or Exchange.at(os.path.abspath(workdir))
    for role in roles:
        local_log = os.path.join(os.path.abspath(workdir), f"{ROLE_LOGS[role]}.jsonl")
        record = read_heartbeat(exchange, role)
        found = [exchange.where(heartbeat_key(role))] if record is not None else []
        found += [local_log] if os.path.exists(local_log) else []
        if not found:
            continue
        seen = ""
        if record is not None:
            state = record.get("exit") or "no exit marker"
            seen = (
                f"; its heartbeat: pid {record['pid']} on {record['host']}, step "
                f"{record.get('step')}, {state}, {time.time() - record['time']:.0f} s ago"
            )
        raise WorkdirReusedError(
            f"an earlier {role} run left {', '.join(found)}{seen}; the disaggregated runner "
            "cannot resume (it keeps no optimizer state): start fresh (--fresh moves the workdir "
            "aside: `trace_jax.rl.workdir.move_aside`; an exchange elsewhere needs a new "
            "location) or use another workdir"
        )


def _watching(
    config: ExperimentConfig, exchange: Exchange, role: str
) -> tuple[Heartbeat, PartnerWatch]:
    """This role's heartbeat (beating a few times per `heartbeat_timeout_s`) and the watch of
    its partner."""
    timeout_s = config.disaggregated.heartbeat_timeout_s
    return (
        Heartbeat(exchange, role, interval_s=min(1.0, timeout_s / 4)),
        PartnerWatch(exchange, PARTNER[role], timeout_s),
    )


def save_rollout(exchange: Exchange, batch: RolloutBatch) -> None:
    """Commits the batch without its guidance (that goes through the store) as the bundle
    `rollout_prefix(batch.step)`."""
    roll = batch.rollout
    arrays = {k: np.asarray(getattr(roll, k)) for k in (*ROLLOUT_FIELDS, "expert_choices")}
    meta = {"step": batch.step, "policy_version": batch.policy_version}
    exchange.write_arrays(rollout_prefix(batch.step), arrays, meta)


def load_rollout(exchange: Exchange, step: int) -> RolloutBatch:
    """The batch `save_rollout` committed for `step` (device arrays, empty guidance, no
    reference codes), verified: ExchangeCorruptError names what is damaged."""
    prefix = rollout_prefix(step)
    meta, arrays = exchange.read_arrays(prefix)
    fields = (*ROLLOUT_FIELDS, "expert_choices")
    if sorted(arrays) != sorted(fields) or meta.get("step") != step:
        raise ExchangeCorruptError(
            f"{exchange.where(prefix)} is no rollout batch of step {step}: step "
            f"{meta.get('step')!r}, arrays {sorted(arrays)} (expected {sorted(fields)})"
        )
    roll = Rollout(**{k: jnp.asarray(arrays[k]) for k in fields}, guidance={})
    return RolloutBatch(step, int(meta["policy_version"]), roll)


def publish_rollout(
    store: GuidanceStore, worker: RolloutWorker, batch: RolloutBatch, exchange: Exchange
) -> None:
    """Rollout -> trainer: the step's guidance into the store, then the batch bundle; the
    trainer waits for that bundle, so it is committed only once every guidance entry of the
    step is."""
    worker.publish_guidance(store, batch)
    store.flush()
    save_rollout(exchange, batch)


def run_rollout(config: ExperimentConfig, workdir: str) -> list[dict]:
    """The rollout process: for each step, wait for its policy version, load it, sample, publish.
    Returns its log rows (`rollout_log.jsonl` in `workdir`): policy version and seconds per
    phase."""
    exchange = run_exchange(config, workdir)
    refuse_reused_workdir(workdir, ("rollout",), exchange)
    guard_workdir(workdir, "disaggregated", config)  # a workdir of other settings is refused
    beat, partner = _watching(config, exchange, "rollout")
    with beat:  # from here on the trainer sees this process alive, or how it ended
        return _rollout_steps(config, workdir, exchange, beat, partner)


def _rollout_steps(
    config: ExperimentConfig,
    workdir: str,
    exchange: Exchange,
    beat: Heartbeat,
    partner: PartnerWatch,
) -> list[dict]:
    lag, timeout_s = config.disaggregated.lag, config.disaggregated.timeout_s
    mesh = experiment_mesh(config.mesh.data, config.mesh.expert, config.mesh.fsdp)
    worker = RolloutWorker(config, init_policy(config, mesh), config.method_setup(), mesh)
    rows, m = [], config.rl.grpo.mini_batches

    def wait(key: str, what: str, stop: threading.Event) -> None:
        wait_for(exchange, key, what, timeout_s, partner=partner, stop=stop)

    params = nnx.state(worker.model, nnx.Param)  # the layout every version is placed in
    with (
        GuidanceStore(exchange.sub_config("guidance/")) as store,
        MetricsLog(workdir, "rollout_log") as rollout_log,
        PolicyPrefetcher(exchange, params, wait) as policies,
    ):
        versions = [max(0, step - lag) * m for step in range(config.rl.steps)]
        loaded = None
        policies.prefetch(versions[0])
        for step, version in enumerate(versions):
            beat.step = step
            t0 = time.perf_counter()
            if version != loaded:  # the prefetched version, placed on the devices
                nnx.update(worker.model, policies.take(version))
                loaded = version
            upcoming = versions[step + 1] if step + 1 < len(versions) else loaded
            if upcoming != loaded:  # read behind this step's rollout
                policies.prefetch(upcoming)
            t1 = time.perf_counter()
            batch = worker.rollout(step, version)  # mismatch statistics: RLLoop only
            t2 = time.perf_counter()
            publish_rollout(store, worker, batch, exchange)
            t3 = time.perf_counter()
            row = {
                "policy_version": version,
                # Waiting for the version and placing it; reading it runs behind the rollout.
                "time_wait_policy_s": t1 - t0,
                "time_rollout_s": t2 - t1,
                "time_publish_s": t3 - t2,
            }
            rows.append(rollout_log.write(step, row))
    return rows


def run_trainer(config: ExperimentConfig, workdir: str) -> list[dict]:
    """The trainer process: publish version 0, then per step wait for the batch, train, publish
    the new version. Returns its metric rows (`rl_metrics.jsonl` in `workdir`)."""
    exchange = run_exchange(config, workdir)
    refuse_reused_workdir(workdir, ("trainer",), exchange)
    guard_workdir(workdir, "disaggregated", config)  # a workdir of other settings is refused
    beat, partner = _watching(config, exchange, "trainer")
    with beat:  # from here on the rollout process sees this one alive, or how it ended
        return _trainer_steps(config, workdir, exchange, beat, partner)


def _trainer_steps(
    config: ExperimentConfig,
    workdir: str,
    exchange: Exchange,
    beat: Heartbeat,
    partner: PartnerWatch,
) -> list[dict]:
    mesh = experiment_mesh(config.mesh.data, config.mesh.expert, config.mesh.fsdp)
    trainer = Trainer(config, init_policy(config, mesh), config.method_setup(), mesh)
    m, timeout_s = config.rl.grpo.mini_batches, config.disaggregated.timeout_s
    # The rollout of step t + 1 reads version (t + 1 - lag) * m while this publishes (t + 1) * m.
    kept = config.disaggregated.lag + 2
    history = []
    with (
        GuidanceStore(exchange.sub_config("guidance/")) as store,
        MetricsLog(workdir, "rl_metrics") as metrics_log,
        PolicyPublisher(exchange) as publisher,  # closed first: the last version committed
    ):
        publish_policy(exchange, trainer.model, 0)
        for step in range(config.rl.steps):
            beat.step = step
            t0 = time.perf_counter()
            key = manifest_key(rollout_prefix(step))
            wait_for(exchange, key, f"rollout batch of step {step}", timeout_s, partner=partner)
            batch = load_rollout(exchange, step)
            t1 = time.perf_counter()
            metrics, blocked = trainer.train(batch, store)
            t2 = time.perf_counter()
            # The new version is written behind the next step's wait for its batch; the
            # consumed batch and the oldest version still kept go after it.
            old = (policy_prefix((step + 1 - kept) * m),) if step + 1 >= kept else ()
            publish_wait = publisher.submit(
                trainer.model, (step + 1) * m, delete=(rollout_prefix(step), *old)
            )
            t3 = time.perf_counter()
            row = {
                **metrics,
                "policy_version": step * m,
                "rollout_policy_version": batch.policy_version,
                "max_staleness_used": step * m + m - 1 - batch.policy_version,
                "time_wait_rollout_s": t1 - t0,
                "time_guidance_io_s": blocked["read"] + blocked["delete_wait"],
                "time_guidance_delete_wait_s": blocked["delete_wait"],
                "time_train_s": t2 - t1 - blocked["read"] - blocked["delete_wait"],
                # Waiting for the previous version's write to end before starting this one's.
                "time_publish_wait_s": publish_wait,
                "time_step_s": t3 - t0,  # the batch's wait, training, starting the publish
            }
            history.append(metrics_log.write(step, row))
    trainer.close()  # the last step's background deletion: its failure raises here
    return history
