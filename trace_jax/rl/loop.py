"""`RLLoop`: GRPO with FP4 rollouts and any registered method, on one process or as one program
on every process of a multi-process run (`trace_jax.distributed`); resumable.

  loop = RLLoop(ExperimentConfig.from_config_dict(cd), workdir)
  history = loop.run()            # rerun on the same workdir to resume after a kill

Each step: sample `prompts_per_step` training problems x `group_size` with the method's rollout
recipe (FP4 W/A/KV for the FP4 methods) while capturing guidance (`RolloutWorker`), pass the
guidance through the tensorstore guidance store (written asynchronously, read back verified and
version-checked in the background while the trainer trains on the rollout's own device copy, so
the step waits only for that check), score the responses and run the method's GRPO update
(`Trainer`). Rollout and trainer share one model here; the disaggregated
runner (`trace_jax.rl.disaggregated`) runs them as two processes.

On several processes every process runs the loop on one mesh over all their devices: each
samples and scores the rows its devices hold, the steps reduce over the global batch, and the
metrics are the same on every process; process 0 alone writes the logs and the run's settings,
and every process takes part in each checkpoint (orbax writes them collectively). The workdir
lies on a filesystem every process reaches.

Writes into `workdir`: `rl_metrics.jsonl` (per step: reward, response length, train-rollout
log-prob gap, clip / truncated-IS fractions, guidance RTN fallbacks, code mismatch on
mismatch-measuring steps, time split into rollout / guidance I/O / training), `rl_eval.jsonl`
(pass@1 per split every `eval_every` steps), TensorBoard scalars of both under `tensorboard/`,
orbax checkpoints `rl_checkpoints/`, the guidance store `guidance/` and the run's settings
`rl_config.json` (`trace_jax.rl.workdir`: a rerun with other settings is refused).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence

import jax
from tqdm import tqdm

from trace_jax.distributed import check_mesh_spans_processes, is_primary, on_primary
from trace_jax.faults import maybe_die
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig
from trace_jax.quant import SiteMode
from trace_jax.rl.checkpoint import checkpoint_manager, restore_train_state, save_train_state
from trace_jax.rl.evaluate import BF16_SUFFIX, EvalSuite, pass_at_1_by_split
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.metrics_log import MetricsLog, drop_rows_from
from trace_jax.rl.sharding import experiment_mesh
from trace_jax.rl.workdir import guard_workdir
from trace_jax.rl.workers import (
    RolloutBatch,
    RolloutWorker,
    Trainer,
    init_policy,
    step_problems,
)

__all__ = ["RLLoop", "RolloutBatch", "step_problems"]

log = logging.getLogger(__name__)


class RLLoop:
    """The learner: owns the policy, the optimizer, the guidance store and the checkpoints, and
    runs rollout -> store -> update steps.

    Attributes:
      config: the `ExperimentConfig`. workdir: where the run's state goes (module docstring).
      mesh: the (data, fsdp, expert) device mesh of `config.mesh`, or None on one device.
      setup: the method resolved for the recipe and model (`MethodSetup`).
      model: the policy (NNX), initialized from `config.rl.init_from` when set.
      optimizer: its `nnx.Optimizer`. store: the run's `GuidanceStore`.
      rollout_worker, trainer: the two sides of a step, sharing `model`.
      checkpoints: the orbax `CheckpointManager` of `rl_checkpoints/`.
    """

    def __init__(self, config: ExperimentConfig, workdir: str):
        self.config = config
        self.workdir = os.path.abspath(workdir)
        mesh = config.mesh
        self.mesh = experiment_mesh(mesh.data, mesh.expert, mesh.fsdp)  # devices, before files
        check_mesh_spans_processes(self.mesh)
        os.makedirs(self.workdir, exist_ok=True)
        self.setup = config.method_setup()
        self.model = init_policy(config, self.mesh)
        self.rollout_worker = RolloutWorker(config, self.model, self.setup, self.mesh)
        self.trainer = Trainer(config, self.model, self.setup, self.mesh)
        self.optimizer = self.trainer.optimizer
        self.store = GuidanceStore(
            GuidanceStoreConfig(kvstore=os.path.join(self.workdir, "guidance"))
        )
        self.checkpoints = checkpoint_manager(
            os.path.join(self.workdir, "rl_checkpoints"), config.rl.checkpoint_every
        )

    def restore(self) -> int:
        """Restores the model and optimizer from the last checkpoint, if any; returns the first
        step to run (0, or that checkpoint's step + 1)."""
        last = self.checkpoints.latest_step()
        if last is None:
            return 0
        # The newest checkpoint that verifies: a corrupt one falls back to an older step.
        last = restore_train_state(self.checkpoints, last, self.model, self.optimizer)
        log.info("restored the policy and optimizer of step %d", last)
        return last + 1

    def policy_version(self, step: int) -> int:
        """The policy version (optimizer steps so far) when step `step` starts."""
        return step * self.config.rl.grpo.mini_batches

    def rollout_step(self, step: int) -> RolloutBatch:
        """Samples step `step`'s batch with the current policy (full reference codes too on
        mismatch-measuring steps)."""
        worker = self.rollout_worker
        return worker.rollout(
            step, self.policy_version(step), reference=worker.measures_mismatch(step)
        )

    def publish_guidance(self, batch: RolloutBatch) -> list[concurrent.futures.Future]:
        """Starts writing the batch's guidance to the store; one future per mini-batch."""
        return self.rollout_worker.publish_guidance(self.store, batch)

    def train_step(
        self, batch: RolloutBatch, writes: Sequence[concurrent.futures.Future] = ()
    ) -> dict[str, float]:
        """The GRPO update on `batch` (`Trainer.train`): its metrics, plus the seconds it was
        blocked on the store, `time_guidance_write_wait_s` (waiting for `writes`),
        `time_guidance_read_s` (reading entries) and `time_guidance_delete_wait_s` (waiting for
        the previous step's deletion). Raises FloatingPointError on a NaN loss."""
        metrics, blocked = self.trainer.train(batch, self.store, writes)
        self.store.flush()  # every write was waited for: this raises only earlier failures
        return {
            **metrics,
            "time_guidance_write_wait_s": blocked["write_wait"],
            "time_guidance_read_s": blocked["read"],
            "time_guidance_delete_wait_s": blocked["delete_wait"],
        }

    def evaluate(self, step: int) -> dict:
        """pass@1 per held-out split of the policy in its rollout execution (the method's FP4
        recipe), and in bf16 as `<split>@bf16` when `eval.in_bf16_too` (FP4 methods; the same
        keys); appends the row (`step` and split -> pass@1) to `rl_eval.jsonl`."""
        suite = EvalSuite.from_config(self.config)
        keys = [jax.random.key(step)] * len(suite.splits)
        run = dict(implementation=self.config.rl.rollout_implementation, mesh=self.mesh)
        mode = self.setup.rollout_mode
        scores = pass_at_1_by_split(
            self.model, suite, keys, qcfg=self.setup.rollout_qcfg, mode=mode, **run
        )
        if self.config.eval.in_bf16_too and mode is not SiteMode.OFF:
            bf16 = pass_at_1_by_split(self.model, suite, keys, mode=SiteMode.OFF, **run)
            scores.update({f"{name}{BF16_SUFFIX}": v for name, v in bf16.items()})
        if is_primary():
            with MetricsLog(self.workdir, "rl_eval", append=True) as eval_log:
                eval_log.write(step, scores)
        row = {"step": step, **scores}
        log.info("eval %s", row)
        return row

    def save(self, step: int, force: bool = False) -> None:
        """Checkpoints the model and optimizer as `step` when `step` is a multiple of
        `checkpoint_every`, or when `force`d (written in the background)."""
        save_train_state(self.checkpoints, step, self.model, self.optimizer, force=force)

    def run(
        self,
        *,
        stop_after: int | None = None,
        before_step: Callable[[int], None] | None = None,
    ) -> list[dict]:
        """Trains from the last checkpoint (or step 0) to `config.rl.steps`; returns the metric
        rows of the steps it ran, then closes the store and the checkpoints. A workdir of a run
        with other settings is refused first (`trace_jax.rl.workdir.guard_workdir`).

        `stop_after` ends the run after that many steps, as if it were killed (a chunk of a
        longer run; rerunning resumes after it). What an interrupted attempt did after its
        last checkpoint is redone: its guidance entries and log rows are dropped first.
        `before_step(step)` is called before each step starts (e.g. to profile the last steps
        of a run, whose functions earlier steps compiled).
        """
        rl = self.config.rl
        try:
            # Refuses a workdir of other settings.
            on_primary(lambda: guard_workdir(self.workdir, "rl", self.config), "guard_workdir")
            start = self.restore()  # raises when no checkpoint is good
            stale, dropped = on_primary(lambda: self._discard_from(start), "discard") or ([], {})
        except Exception:
            self.close()  # the checkpoints, the store and the trainer's threads
            raise
        if stale or any(dropped.values()):
            log.info(
                "resuming at step %d: dropped %d guidance entries and %s log rows of an "
                "interrupted attempt",
                start,
                len(stale),
                dropped,
            )
        history = []
        with self, contextlib.ExitStack() as logs:
            metrics_log = None
            if is_primary():  # the others return their rows only
                metrics_log = MetricsLog(self.workdir, "rl_metrics", append=bool(start))
                logs.enter_context(metrics_log)
            steps = tqdm(
                range(start, rl.steps),
                desc=f"rl {rl.method}",
                initial=start,
                total=rl.steps,
                disable=not is_primary(),
            )
            for step in steps:
                if before_step is not None:
                    before_step(step)
                t0 = time.perf_counter()
                batch = self.rollout_step(step)
                t1 = time.perf_counter()
                maybe_die("rollout", step)  # TRACE_JAX_FAULT, for recovery tests
                writes = self.publish_guidance(batch)
                t2 = time.perf_counter()
                metrics = self.train_step(batch, writes)
                t3 = time.perf_counter()
                write_wait = metrics.pop("time_guidance_write_wait_s")
                read = metrics["time_guidance_read_s"]
                delete_wait = metrics["time_guidance_delete_wait_s"]
                row = {
                    **metrics,
                    "policy_version": batch.policy_version,
                    "max_staleness_used": rl.grpo.mini_batches - 1,
                    "time_rollout_s": t1 - t0,
                    # Only the waits count: the write and its verified read-back run behind the
                    # trainer's device work.
                    "time_guidance_io_s": t2 - t1 + write_wait + read + delete_wait,
                    "time_guidance_write_s": t2 - t1 + write_wait,  # until committed
                    "time_train_s": t3 - t2 - write_wait - read - delete_wait,
                }
                row = metrics_log.write(step, row) if metrics_log else {"step": step, **row}
                history.append(row)
                chunk_end = stop_after is not None and step + 1 - start >= stop_after
                # The final policy and a chunk's last step are always saved: the interval alone
                # skips them (steps 0..99 every 25 end at 75, and a resumed chunk would redo
                # the steps after its last multiple).
                self.save(step, force=step == rl.steps - 1 or chunk_end)
                if rl.eval_every and (step + 1) % rl.eval_every == 0:
                    self.evaluate(step)
                if chunk_end:
                    break
        return history

    def _discard_from(self, start: int) -> tuple[list, dict[str, int]]:
        """Drops what an interrupted attempt left from step `start` on: its guidance entries
        (the store refuses to overwrite committed ones) and its log rows (they would appear
        twice); returns (the entries, log name -> rows dropped)."""
        stale = self.store.discard_from(self.config.rl.run_id, start)
        dropped = {n: drop_rows_from(self.workdir, n, start) for n in ("rl_metrics", "rl_eval")}
        return stale, dropped

    def close(self) -> None:
        """Waits for checkpoint writes, the trainer's guidance work and pending guidance writes;
        closes all three."""
        try:
            self.checkpoints.wait_until_finished()
            self.checkpoints.close()
        finally:
            try:
                self.trainer.close()
            finally:
                self.store.close()

    def __enter__(self) -> RLLoop:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not mask the exception in flight (a NaN loss, a failed read)
            self.close()
        except Exception as e:
            log.error("while closing the RL loop: %s", e)
