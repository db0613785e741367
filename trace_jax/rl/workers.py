"""The two sides of an RL step: a rollout worker and a trainer, linked by the guidance store.

  worker = RolloutWorker(config, model, setup, mesh)
  batch = worker.rollout(step, policy_version)           # sample, capture guidance
  writes = worker.publish_guidance(store, batch)         # guidance -> store (async)
  trainer = Trainer(config, model, setup, mesh)
  metrics, blocked = trainer.train(batch, store, writes)  # store -> verified guidance -> GRPO

`RLLoop` composes the two in one process around one model (no parameters travel); the
disaggregated runner gives each its own process and model, linked by policy checkpoints,
rollout files and the store. A method plugs in through its `MethodSetup` alone: the rollout
recipe and what it captures, the trainer's recipe and its loss.

Guidance off the critical path: a batch that still holds its rollout's guidance on the device (one
process) trains on it at once, while background threads wait for each committed entry, read it
back verified and version-checked, and check that it holds exactly those bytes (the very arrays
the worker wrote: `RolloutBatch.mini_batches`); the step returns only when every entry checked. A
batch without guidance (loaded from a file: another process sampled it) trains on the entries
read from the store, each read in the background from the moment the step starts. Either way the
step's entries are deleted on a thread of their own during the next step (deleting a file
store's directories takes about as long as a step); a failure there is raised by the next
`train` or `close`.

Policy versions count optimizer steps: with M mini-batches per step, the trainer holds version
`step * M` when step `step` starts and trains mini-batch m at version `step * M + m`, which is the
version it asks the store for (the store accepts guidance up to `max_staleness` versions older).

Axis legend: B rollout rows (prompts x group), S slots.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from trace_jax import data
from trace_jax.distributed import (
    barrier,
    host_value,
    is_primary,
    process_rows,
    read_rows,
    rows_from_local,
)
from trace_jax.fp4 import Guidance, GuidanceMode
from trace_jax.guidance import GuidanceStore
from trace_jax.guidance.shards import leaf_sharding
from trace_jax.models import Qwen3MoE, init_model, resolve_implementation
from trace_jax.models.hf_checkpoint import model_from_hf_tensors
from trace_jax.models.hf_files import SafetensorsCheckpoint
from trace_jax.quant import SiteMode
from trace_jax.rl.advantages import grpo_advantages
from trace_jax.rl.checkpoint import load_params
from trace_jax.rl.config import make_optimizer
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.guidance_io import (
    GuidanceEntry,
    check_same_guidance,
    read_guidance,
    wait_for_entry,
)
from trace_jax.rl.methods import MethodSetup
from trace_jax.rl.sharding import (
    batch_spec,
    mesh_context,
    param_sharding_rule,
    place_batch,
    place_state,
)
from trace_jax.rl.step import grpo_step, old_logprobs, site_mismatch
from trace_jax.rollout import Rollout, SamplingConfig, generate

log = logging.getLogger(__name__)


def step_problems(config: ExperimentConfig, step: int, n: int) -> list[data.Example]:
    """The first `n` training examples of step `step` (the dataset of `config.tasks`): a pure
    function of (seed, step), so a resumed run replays them."""
    return config.tasks.make_dataset().step_examples(config.seed, step, n)


def group_problems(config: ExperimentConfig, step: int) -> list[data.Example]:
    """Step `step`'s rollout rows: its `prompts_per_step` examples, each `group_size` times."""
    g = config.rl.grpo.group_size
    return [p for p in step_problems(config, step, config.rl.prompts_per_step) for _ in range(g)]


def run_tokenizer(config: ExperimentConfig) -> data.Tokenizer:
    """The tokenizer of `config.tasks`; ValueError when its ids do not fit `config.model`."""
    tokenizer = config.tasks.make_tokenizer()
    data.check_vocab(tokenizer, config.model.vocab_size)
    return tokenizer


def mini_batch_slices(n: int, parts: int) -> list[slice]:
    """`parts` equal row slices of an `n`-row rollout batch (advantages are computed on the whole
    batch first, so groups may span mini-batches)."""
    if n % parts:
        raise ValueError(f"{n} rollouts per step do not split into {parts} equal mini-batches")
    size = n // parts
    return [slice(i * size, (i + 1) * size) for i in range(parts)]


def split_rollout(roll: Rollout, parts: int) -> list[Rollout]:
    """`roll.rows(s)` for each of `mini_batch_slices(B, parts)`, in one dispatch (one slice per
    array of every guided site would each cost a dispatch). On a mesh (`roll.tokens` placed by
    a `NamedSharding`) every guidance leaf of a part comes out with its rows split like a batch
    (`leaf_sharding` of `batch_spec`), whatever placement the sampler's program gave the
    buffers: each process then writes to the store, and checks, the rows it reads back."""
    sharding = roll.tokens.sharding
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
    return _split_rollout(roll, parts, mesh)


@functools.partial(jax.jit, static_argnames=("parts", "mesh"))
def _split_rollout(roll: Rollout, parts: int, mesh: jax.sharding.Mesh | None) -> list[Rollout]:
    out = [roll.rows(rows) for rows in mini_batch_slices(roll.tokens.shape[0], parts)]
    if mesh is None:
        return out
    rows = NamedSharding(mesh, batch_spec(mesh))

    def place(a: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(a, leaf_sharding(rows, a.shape))

    return [dataclasses.replace(r, guidance=jax.tree.map(place, r.guidance)) for r in out]


def initial_model(config: ExperimentConfig, mesh: jax.sharding.Mesh | None) -> Qwen3MoE:
    """`config.model` with the weights of the Hugging Face checkpoint `model.hf_dir`, each
    parameter read straight onto its devices of `mesh` (or the first device), once the
    tokenizer's ids are known to fit; without it, initialized from `config.seed`. What SFT
    starts from."""
    if not config.model_hf_dir:
        return init_model(config.model, seed=config.seed)
    run_tokenizer(config)
    weights = SafetensorsCheckpoint(config.model_hf_dir)
    rule = None if mesh is None else param_sharding_rule(mesh)
    return model_from_hf_tensors(config.model, weights, shardings=rule)


def init_policy(config: ExperimentConfig, mesh: jax.sharding.Mesh | None) -> Qwen3MoE:
    """The run's initial policy, placed on `mesh` (or committed to the first device): the
    orbax checkpoint `rl.init_from` when set (it wins over `model.hf_dir`: an SFT checkpoint of
    that model holds the newer weights, so the Hugging Face ones are not read), read straight
    into that placement, else `initial_model`."""
    if config.rl.init_from:
        model = init_model(config.model, seed=config.seed)
        place_state(model, mesh)  # the placement the checkpoint is read into
        load_params(model, config.rl.init_from)
        return model
    model = initial_model(config, mesh)
    place_state(model, mesh)
    return model


def batch_sharding(mesh: jax.sharding.Mesh | None) -> NamedSharding | None:
    """Where a rollout batch's rows go (`sharding.batch_spec`); None without a mesh."""
    return None if mesh is None else NamedSharding(mesh, batch_spec(mesh))


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """One step's sampled batch, as the trainer consumes it.

    step: the RL step (it names the problems: `group_problems(config, step)`).
    policy_version: the version of the policy that sampled it.
    rollout: tokens, log-probs, masks and expert choices `[B, S, ...]`; its `guidance` holds the
      method's own capture (site key -> `Guidance`, device arrays; empty once loaded from a file:
      guidance travels through the store).
    reference: on mismatch-measuring steps, full rollout codes at every quantized site (site key
      -> `Guidance`, FULL); otherwise None.
    """

    step: int
    policy_version: int
    rollout: Rollout
    reference: dict[str, Guidance] | None = None
    _mini_batches: dict[int, list[Rollout]] = dataclasses.field(
        init=False, default_factory=dict, repr=False, compare=False
    )

    def mini_batches(self, parts: int) -> list[Rollout]:
        """`split_rollout(self.rollout, parts)`, split once per batch: the worker writes the
        very arrays the trainer trains on and checks the store's copy against, so the check
        finds their host copies made by the write (one device -> host copy of the guidance per
        step, not two)."""
        if parts not in self._mini_batches:
            self._mini_batches[parts] = split_rollout(self.rollout, parts)
        return self._mini_batches[parts]


class RolloutWorker:
    """Samples a step's batch with the policy `model` and the method's rollout recipe, capturing
    the method's guidance, and publishes that guidance to the store.

    Attributes: config, model (updated in place by whoever owns the policy), setup, mesh,
    tokenizer (`config.tasks`'), sampling (`SamplingConfig` of `config.rl`, the tokenizer's stop
    and pad ids), prompt_width (every step pads its prompts to it: one compiled sampler),
    implementation (the sampler's kernels, "pallas" or "xla": `rl.rollout_implementation`
    resolved on this process's devices).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        model: Qwen3MoE,
        setup: MethodSetup,
        mesh: jax.sharding.Mesh | None = None,
    ):
        self.config, self.model, self.setup, self.mesh = config, model, setup, mesh
        self.tokenizer = run_tokenizer(config)
        self.sampling = SamplingConfig(
            max_new_tokens=config.rl.max_new_tokens,
            temperature=config.rl.temperature,
            stop_tokens=self.tokenizer.stop_ids,
            pad_id=self.tokenizer.pad_id,
        )
        self.prompt_width = config.tasks.make_dataset().prompt_width(self.tokenizer)
        self.implementation = resolve_implementation(config.rl.rollout_implementation)
        self._key = jax.random.key(config.seed)

    def measures_mismatch(self, step: int) -> bool:
        """Whether step `step` measures per-site code mismatch (every `rl.mismatch_every` steps;
        FP4 rollouts only)."""
        every = self.config.rl.mismatch_every
        return bool(every) and step % every == 0 and self.setup.rollout_mode is SiteMode.RTN

    def rollout(self, step: int, policy_version: int, *, reference: bool = False) -> RolloutBatch:
        """Samples step `step`'s batch (B = prompts_per_step x group_size rows) with the current
        policy, whose version the caller states. Every process calls it; each builds the prompts
        of the rows its devices hold, and the batch is one global array split along its rows
        (`batch_sharding`).

        With `reference`, the rollout records full codes at every quantized site (the batch's
        `reference`, for mismatch statistics) and the method's guidance is derived from them
        (compact guidance = the codes' mantissa bits), so the run is the same either way.
        """
        problems = group_problems(self.config, step)
        n, sharding = len(problems), batch_sharding(self.mesh)
        # Each process encodes the rows its devices hold, of the same global batch.
        prompts, lengths = data.encode_prompts(
            problems[process_rows(sharding, n)], pad_to=self.prompt_width, tokenizer=self.tokenizer
        )
        prompts, lengths = rows_from_local((prompts, lengths), sharding, n)
        setup = self.setup
        capture, capture_mode = setup.capture, setup.capture_mode
        if reference:
            capture = setup.rollout_qcfg.all_keys(self.model.cfg.n_layers)
            capture_mode = GuidanceMode.FULL
        graphdef, params = nnx.split(self.model)
        with mesh_context(self.mesh):
            roll = generate(
                graphdef,
                params,
                prompts,
                lengths,
                jax.random.fold_in(self._key, step),
                sampling=self.sampling,
                qcfg=setup.rollout_qcfg,
                mode=setup.rollout_mode,
                capture=capture,
                capture_mode=capture_mode,
                implementation=self.implementation.value,
                residual_fraction=setup.rollout_residual_channels,
            )
        jax.block_until_ready(roll.tokens)
        if not reference:
            return RolloutBatch(step, policy_version, roll)
        full = roll.guidance
        own = {
            k: full[k] if setup.capture_mode is GuidanceMode.FULL else full[k].as_compact()
            for k in setup.capture
        }
        return RolloutBatch(step, policy_version, dataclasses.replace(roll, guidance=own), full)

    def publish_guidance(
        self, store: GuidanceStore, batch: RolloutBatch
    ) -> list[concurrent.futures.Future]:
        """Rollout -> store: starts writing one entry per mini-batch, stamped with the batch's
        policy version, and returns their futures at once (none for a method without guidance).
        The trainer's background thread waits for each before reading its entry back, so the
        writes run behind the reward scoring and the trainer's device work. On several
        processes every process calls it (the store's writes of global arrays are collective:
        each process writes the rows its devices hold, process 0 commits)."""
        if not self.setup.capture:
            return []
        rl, v = self.config.rl, batch.policy_version
        return [
            store.write_async(rl.run_id, batch.step, p.guidance, policy_version=v, micro_batch=m)
            for m, p in enumerate(batch.mini_batches(rl.grpo.mini_batches))
        ]


def mismatch_metrics(stats: dict[str, dict]) -> dict[str, float]:
    """Per-site mismatch fractions (`mismatch/<site>`) from `site_mismatch`'s statistics; over all
    sites, weighted by element count, `code_mismatch` and, when there are mismatches, the
    fraction of them one adjacent code apart (`one_apart_fraction`)."""
    out = {}
    n = n_mis = n_one = 0
    for key, st in sorted(stats.items()):
        out[f"mismatch/{key}"] = float(st["mismatch"])
        n += int(st["n_elements"])
        n_mis += int(st["n_mismatch"])
        n_one += int(st["n_one_apart"])
    if not n:  # the trainer quantizes nothing (bf16 training, QUADS): no codes to compare
        return out
    out["code_mismatch"] = n_mis / n
    if n_mis:  # undefined without mismatches (and NaN would litter the logs)
        out["one_apart_fraction"] = n_one / n_mis
    return out


class Trainer:
    """Scores rollout batches and runs the method's GRPO update on the policy `model`, one
    optimizer step per mini-batch, each mini-batch's guidance checked against the store.

    Attributes: config, model, setup, mesh, tokenizer and verifier (`config.tasks`': responses
    -> text -> rewards), optimizer (AdamW on `rl.grpo`'s schedule over `rl.steps *
    mini_batches` optimizer steps, placed like the model).

    Guidance reads and checks run on background threads, one entry each, and deletions on
    another (module docstring); `close()` waits for the last deletion and raises its failure.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        model: Qwen3MoE,
        setup: MethodSetup,
        mesh: jax.sharding.Mesh | None = None,
    ):
        self.config, self.model, self.setup, self.mesh = config, model, setup, mesh
        self.tokenizer, self.verifier = run_tokenizer(config), config.tasks.make_verifier()
        grpo = config.rl.grpo
        self.optimizer = nnx.Optimizer(
            model, make_optimizer(grpo, config.rl.steps * grpo.mini_batches), wrt=nnx.Param
        )
        place_state(self.optimizer, mesh, model)
        # A thread per mini-batch's entry (up to 4): each waits for its own write, so the reads
        # and checks of a step overlap; started in mini-batch order.
        self._io = concurrent.futures.ThreadPoolExecutor(
            min(grpo.mini_batches, 4), thread_name_prefix="trainer-guidance"
        )
        # Deletions on their own thread: a step's entries are deleted while the next step's are
        # written and read, not before them.
        self._gc = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer-gc")
        self._cleanup: concurrent.futures.Future | None = None

    def train(
        self,
        batch: RolloutBatch,
        store: GuidanceStore,
        writes: Sequence[concurrent.futures.Future] = (),
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Scores `batch` and runs the update; deletes the step's consumed guidance entries
        (in the background, during the next step: the next `train` returns or raises only once
        they are deleted).

        The trainer must hold version `batch.step * M` (M mini-batches). `writes`: this
        process's pending writes of the step's entries (`RolloutWorker.publish_guidance`, one
        per mini-batch), each waited for before its entry is read; without them the entries
        must be committed already (another process wrote them). A batch holding its rollout's
        guidance trains on it and returns once every entry read back equal to it (else
        GuidanceCorruptError); a batch without trains on the entries read. With
        `batch.reference`, the trainer's code mismatch per site is measured on the first
        mini-batch before any update.

        Returns (metrics averaged over mini-batches, with the reward and response length; the
        seconds the step was blocked on the store: {"write_wait": waiting for an entry's
        write, "read": waiting for its read, host -> device included, "delete_wait": waiting,
        after the update, for the previous step's deletion to end}). Raises
        FloatingPointError on a non-finite loss, and the failure of the previous step's
        background deletion (before any work when it has failed already).
        """
        cleanup = self._cleanup
        if cleanup is not None and cleanup.done():
            self._settle_cleanup()
        try:
            metrics, blocked = self._update(batch, store, writes)
        except BaseException:
            if self._cleanup is not None:  # the store settled before the failure propagates
                concurrent.futures.wait([self._cleanup])
            raise
        t0 = time.perf_counter()
        self._settle_cleanup()  # the previous step's deletion, run beside this step
        blocked["delete_wait"] = time.perf_counter() - t0
        if self.setup.capture:
            barrier(f"trainer read guidance of step {batch.step}")  # before process 0 deletes it
            if is_primary():
                self._cleanup = self._gc.submit(store.gc, self.config.rl.run_id, batch.step)
                self._cleanup.add_done_callback(_log_failure)
        return metrics, blocked

    def _update(self, batch: RolloutBatch, store: GuidanceStore, writes: Sequence) -> tuple:
        """`train` but for the deletions."""
        rl, grpo, setup = self.config.rl, self.config.rl.grpo, self.setup
        roll, step = batch.rollout, batch.step
        problems = group_problems(self.config, step)
        slices = mini_batch_slices(len(problems), grpo.mini_batches)
        if writes and len(writes) != len(slices):
            raise ValueError(
                f"{len(writes)} pending guidance writes for {len(slices)} mini-batches"
            )
        parts = batch.mini_batches(grpo.mini_batches)
        on_device = bool(setup.capture) and bool(roll.guidance)
        entries = []
        if setup.capture:  # started now: the reads run behind the scoring and the device work
            entries = [
                self._io.submit(
                    self._fetch_entry,
                    store,
                    step,
                    m,
                    writes[m] if writes else None,
                    part.guidance if on_device else None,
                    rows.stop - rows.start,
                )
                for m, (rows, part) in enumerate(zip(slices, parts, strict=True))
            ]
        # Each process scores the rows its devices hold; advantages normalize over whole groups
        # of the global rewards (inside the jitted ops: groups may span processes).
        n, sharding = len(problems), batch_sharding(self.mesh)
        here = process_rows(sharding, n)
        responses = data.responses_from_rollout(
            *(read_rows(x, here) for x in (roll.tokens, roll.prompt_lengths, roll.lengths))
        )
        rewards = data.compute_rewards(
            problems[here], responses, tokenizer=self.tokenizer, verifier=self.verifier
        )
        rewards = rows_from_local(rewards, sharding, n)
        adv = grpo_advantages(rewards, grpo.group_size)
        kw = dict(setup=setup, grpo=grpo, temperature=rl.temperature)
        mini_batches, blocked = [], {"write_wait": 0.0, "read": 0.0}
        with mesh_context(self.mesh):
            for m, (rows, part) in enumerate(zip(slices, parts, strict=True)):
                if setup.capture and not on_device:  # store -> trainer, placed already
                    guidance = wait_for_entry(entries[m], blocked).guidance
                    part = dataclasses.replace(part, guidance=guidance)
                # PPO's pi_old: the policy at the start of the step, before any mini-batch
                # update, with the guidance the store holds.
                mini_batches.append((rows, part, old_logprobs(self.model, part, **kw)))
            mismatch = {}
            if batch.reference is not None:
                rows, part, _ = mini_batches[0]
                ref = {
                    k: jax.tree.map(lambda a, r=rows: a[r], g) for k, g in batch.reference.items()
                }
                stats = host_value(site_mismatch(self.model, part, ref, **kw))
                mismatch = mismatch_metrics(stats)
            mb_metrics = [
                grpo_step(self.model, self.optimizer, part, adv[rows], lp_old, **kw)
                for rows, part, lp_old in mini_batches
            ]
            response_tokens = jnp.sum(roll.response_mask, dtype=jnp.int32)
        # Every process holds the same reduced metrics (the steps reduce over the global batch).
        mb_metrics, response_tokens, rewards = host_value((mb_metrics, response_tokens, rewards))
        # Mini-batch metrics averaged (each is a mean over its own tokens / sequences).
        metrics = {k: float(np.mean([float(x[k]) for x in mb_metrics])) for k in mb_metrics[0]}
        if not np.isfinite(metrics["loss"]):
            raise FloatingPointError(f"loss is {metrics['loss']} at step {step}")
        if on_device:  # what the device's work did not hide of the entries' checks
            for entry in entries:
                wait_for_entry(entry, blocked)
        metrics = {
            "reward": float(np.mean(rewards)),
            "response_length": int(response_tokens) / n,
            **metrics,
            **mismatch,
        }
        return metrics, blocked

    def close(self) -> None:
        """Waits for the background deletion of the last step's entries (raising its failure)
        and stops the background threads. Idempotent."""
        try:
            self._settle_cleanup()
        finally:
            self._io.shutdown(wait=True)
            self._gc.shutdown(wait=True)

    def _fetch_entry(
        self,
        store: GuidanceStore,
        step: int,
        m: int,
        write: concurrent.futures.Future | None,
        own: dict[str, Guidance] | None,
        rows: int,
    ) -> GuidanceEntry:
        """(Background thread.) Mini-batch `m`'s entry (`rows` rows), read once `write`
        committed: checked equal to `own` (the guidance trained on) when given, else put on the
        devices (the trainer's main thread only dispatches)."""
        grpo = self.config.rl.grpo
        t0 = time.perf_counter()
        guidance, waited = read_guidance(
            store,
            self.config.rl.run_id,
            step,
            m,
            mini_batches=grpo.mini_batches,
            max_staleness=grpo.max_staleness,
            write=write,
            sharding=batch_sharding(self.mesh),  # each process reads its own rows
        )
        if own is not None:
            check_same_guidance(guidance, own, f"guidance of step {step}, mini-batch {m}")
        else:
            guidance = place_batch(guidance, self.mesh, rows)
        return GuidanceEntry(guidance, t0 + waited["write_wait"])

    def _settle_cleanup(self) -> None:
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup.result()


def _log_failure(future: concurrent.futures.Future) -> None:
    """Logs a failed background deletion when it happens (`train` or `close` raises it)."""
    if not future.cancelled() and future.exception() is not None:
        log.error("deleting consumed guidance failed: %s", future.exception())
