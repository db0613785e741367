r"""GRPO with FP4 rollouts and any of the paper's methods; resumable.

  python -m experiments.main --config=configs/tiny_cpu.py --workdir=/tmp/trace_tiny \
      --config.rl.init_from=/tmp/trace_tiny/sft_checkpoint --config.rl.method=trace

Each step: sample `prompts_per_step` training problems x `group_size`, roll out with the method's
rollout recipe (FP4 W/A/KV for the FP4 methods) while capturing guidance, pass the guidance through
the tensorstore guidance store (write async -> read back, version-checked; the writes run behind
the reward scoring), score the responses,
and run the method's GRPO update. Writes to --workdir: `rl_metrics.jsonl` (reward, response
length, train-rollout log-prob gap, clip / truncated-IS fractions, guidance RTN fallbacks, time
split into rollout / guidance I/O / training), `rl_eval.jsonl` (pass@1 per split), TensorBoard
scalars of both under `tensorboard/`, `rl_curves.png`,
orbax checkpoints `rl_checkpoints/` (resume: rerun the same command).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags
from tqdm import tqdm

from experiments import sft
from trace_jax import tasks
from trace_jax.fp4 import Guidance, GuidanceMode
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig
from trace_jax.models import init_model
from trace_jax.quant import SiteMode
from trace_jax.rl.advantages import grpo_advantages
from trace_jax.rl.config import GRPOConfig, make_optimizer
from trace_jax.rl.evaluate import evaluate_pass_at_1
from trace_jax.rl.methods import MethodSetup, get_method, layers_from_spec
from trace_jax.rl.metrics_log import MetricsLog, drop_rows_from, read_rows
from trace_jax.rl.sharding import make_mesh, shard_batch, shard_model, shard_optimizer
from trace_jax.rl.step import grpo_step, old_logprobs, site_mismatch
from trace_jax.rollout import Rollout, SamplingConfig, generate

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _problems(cfg, step: int, n: int) -> list[tasks.Problem]:
    """The step's training problems (kinds and levels from `cfg.tasks`): a pure function of
    (seed, step), so resumes replay them."""
    stream = tasks.train_stream(
        cfg.seed * 1_000_003 + step, tasks=cfg.tasks.kinds, levels=cfg.tasks.levels
    )
    return list(itertools.islice(stream, n))


def _mini_batches(n: int, parts: int) -> list[slice]:
    """`parts` equal row slices of an `n`-row rollout batch (advantages are computed on the whole
    batch first, so groups may span mini-batches)."""
    if n % parts:
        raise ValueError(f"{n} rollouts per step do not split into {parts} equal mini-batches")
    size = n // parts
    return [slice(i * size, (i + 1) * size) for i in range(parts)]


def _checkpointer(workdir: str, every: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every)
    return ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "rl_checkpoints"), options=options
    )


@dataclasses.dataclass
class RunParts:
    """What every step of a run uses: the policy (model, optimizer), the method's recipe, the
    GRPO and sampling settings, the fixed prompt width, the run id, the PRNG key, and the device
    mesh (None: one device)."""

    cfg: Any
    model: nnx.Module
    optimizer: nnx.Optimizer
    setup: MethodSetup
    grpo: GRPOConfig
    sampling: SamplingConfig
    prompt_width: int
    run_id: str
    key: jax.Array
    mesh: jax.sharding.Mesh | None = None

    def on_mesh(self, tree, batch_size: int):
        """`tree` on the device(s): batch-leading arrays split along the mesh's data axis, the
        rest replicated (no mesh: on the default device)."""
        return (
            jax.device_put(tree) if self.mesh is None else shard_batch(tree, self.mesh, batch_size)
        )

    def mesh_context(self):
        """The context the run's jitted steps execute in (`jax.set_mesh`; no mesh: nothing)."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)


def run_mesh(cfg) -> jax.sharding.Mesh | None:
    """The (data, expert) mesh of `cfg.mesh`, or None for a 1 x 1 mesh (one device, no sharding).

    data splits the rollout batch (`prompts_per_step * group_size` rows, and every mini-batch,
    must divide evenly), expert splits the routed expert weights along E."""
    m = cfg.get("mesh") or {}
    data, expert = int(m.get("data", 1)), int(m.get("expert", 1))
    if data * expert == 1:
        return None
    rows = cfg.rl.prompts_per_step * cfg.rl.group_size
    if rows % (cfg.rl.mini_batches * data):
        raise ValueError(
            f"{rows} rollouts per step in {cfg.rl.mini_batches} mini-batches do not split over "
            f"mesh.data={data} devices"
        )
    return make_mesh(data, expert)


def guided_layers(rl, n_layers: int) -> tuple[int, ...] | None:
    """The layers `rl.guided_layers` names ("all", "half", "0,3", ...); None: the method's own."""
    return layers_from_spec(rl.guided_layers, n_layers) if rl.guided_layers else None


def prepare(cfg) -> RunParts:
    """The run's policy (initialized, or loaded from `rl.init_from`) and settings."""
    rl = cfg.rl
    mcfg = sft.model_config(cfg)
    model = init_model(mcfg, seed=cfg.seed)
    if rl.init_from:
        sft.load_params(model, rl.init_from)
    setup = get_method(rl.method).setup(
        rl.format, mcfg.n_layers, guided_layers=guided_layers(rl, mcfg.n_layers)
    )
    grpo = GRPOConfig(
        group_size=rl.group_size,
        learning_rate=rl.learning_rate,
        warmup_steps=rl.warmup_steps,
        mini_batches=rl.mini_batches,
        max_staleness=rl.get("max_staleness", GRPOConfig.max_staleness),
        is_cap=rl.is_cap,
        routing_replay=rl.routing_replay,
    )
    optimizer = nnx.Optimizer(
        model, make_optimizer(grpo, rl.steps * rl.mini_batches), wrt=nnx.Param
    )
    mesh = run_mesh(cfg)
    if mesh is not None:
        shard_model(model, mesh)
        shard_optimizer(optimizer, model, mesh)
    else:  # committed to the device, as a checkpoint restores them: one compile per jitted step
        device = jax.devices()[0]
        nnx.update(model, jax.device_put(nnx.state(model), device))
        nnx.update(optimizer, jax.device_put(nnx.state(optimizer), device))
    sampling = SamplingConfig(
        max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature,
        stop_tokens=(tasks.EOS_ID,),
        pad_id=tasks.PAD_ID,
    )
    # One prompt width for every step (the levels' cap), so the sampler compiles once.
    prompt_width = 1 + max(
        tasks.level_spec(t, lv).max_prompt_tokens
        for t in cfg.tasks.kinds
        for lv in cfg.tasks.levels
    )
    return RunParts(
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        setup=setup,
        grpo=grpo,
        sampling=sampling,
        prompt_width=prompt_width,
        run_id=f"{rl.method}_{rl.format}",
        key=jax.random.key(cfg.seed),
        mesh=mesh,
    )


def step_batch(cfg, step: int) -> list[tasks.Problem]:
    """The step's problems, each repeated group_size times (a pure function of seed and step)."""
    return [
        p for p in _problems(cfg, step, cfg.rl.prompts_per_step) for _ in range(cfg.rl.group_size)
    ]


def mismatch_step(parts: RunParts, step: int) -> bool:
    """Whether this step measures per-site code mismatch (`rl.mismatch_every`; FP4 rollouts)."""
    every = parts.cfg.rl.get("mismatch_every", 0)
    return bool(every) and step % every == 0 and parts.setup.rollout_mode is SiteMode.RTN


def rollout_step(
    parts: RunParts, step: int, *, reference: bool = False
) -> tuple[Rollout, dict[str, Guidance] | None]:
    """Samples the step's batch with the current policy and the method's rollout recipe.

    Returns (the rollout with the method's guidance, or None). With `reference`, the rollout also
    records full codes at every quantized site (`reference`, for mismatch statistics) and the
    method's guidance is derived from them (compact guidance = the codes' mantissa bits).
    """
    prompts, lengths = tasks.encode_prompts(step_batch(parts.cfg, step), pad_to=parts.prompt_width)
    prompts, lengths = parts.on_mesh((prompts, lengths), len(prompts))
    gd, params = nnx.split(parts.model)
    setup = parts.setup
    capture, capture_mode = setup.capture, setup.capture_mode
    if reference:
        capture = setup.rollout_qcfg.all_keys(parts.model.cfg.n_layers)
        capture_mode = GuidanceMode.FULL
    roll = generate(
        gd,
        params,
        prompts,
        lengths,
        jax.random.fold_in(parts.key, step),
        sampling=parts.sampling,
        qcfg=setup.rollout_qcfg,
        mode=setup.rollout_mode,
        capture=capture,
        capture_mode=capture_mode,
        residual_fraction=setup.rollout_residual_channels,
    )
    jax.block_until_ready(roll.tokens)
    if not reference:
        return roll, None
    full = roll.guidance
    own = {
        k: full[k] if setup.capture_mode is GuidanceMode.FULL else full[k].as_compact()
        for k in setup.capture
    }
    return dataclasses.replace(roll, guidance=own), full


def write_guidance(
    store: GuidanceStore, parts: RunParts, roll: Rollout, step: int, version: int
) -> list[concurrent.futures.Future]:
    """Rollout -> store: starts writing one entry per mini-batch, stamped with the sampling
    policy's version, and returns their futures at once. The trainer waits for each entry just
    before reading it (`read_guidance`), so the writes run behind the reward scoring and the
    earlier mini-batches' reads instead of in front of them."""
    if not parts.setup.capture:
        return []
    return [
        store.write_async(
            parts.run_id, step, roll.rows(rows).guidance, policy_version=version, micro_batch=m
        )
        for m, rows in enumerate(_mini_batches(roll.tokens.shape[0], parts.cfg.rl.mini_batches))
    ]


def read_guidance(
    store: GuidanceStore,
    parts: RunParts,
    step: int,
    micro_batch: int,
    write: concurrent.futures.Future | None = None,
) -> tuple[dict[str, Guidance], dict[str, float]]:
    """Store -> trainer: mini-batch `micro_batch`'s entry of `step`, read once `write` (this
    process's pending write of it, if any) has committed, version-checked against the trainer's
    version `step * mini_batches + micro_batch`. Returns (host guidance per site, seconds
    {"write_wait": waiting for `write`, "read": reading}); raises the write's failure."""
    w0 = time.perf_counter()
    if write is not None:
        write.result()
    r0 = time.perf_counter()
    guidance = store.read(
        parts.run_id,
        step,
        micro_batch=micro_batch,
        expected_version=step * parts.cfg.rl.mini_batches + micro_batch,
        max_staleness=parts.grpo.max_staleness,
    )
    return guidance, {"write_wait": r0 - w0, "read": time.perf_counter() - r0}


def train_step(
    parts: RunParts,
    store: GuidanceStore,
    roll: Rollout,
    step: int,
    reference: dict[str, Guidance] | None = None,
    writes: Sequence[concurrent.futures.Future] = (),
) -> tuple[dict[str, float], dict[str, float]]:
    """Scores the batch and runs the method's GRPO update, one optimizer step per mini-batch.

    Policy versions count optimizer steps: the trainer holds version `step * M` at the start, and
    mini-batch m is trained by version `step * M + m`, which is what it asks the store for (the
    store accepts guidance up to `max_staleness` versions older). With `reference` (full rollout
    codes at every quantized site), the trainer's code mismatch per site is measured on the first
    mini-batch before any update. `writes`: this process's pending writes of the step's entries
    (`write_guidance`, one per mini-batch), each waited for before its entry is read; without
    them the entries must be committed already (another process wrote them). Returns (metrics
    averaged over mini-batches with reward and response length, seconds the step was blocked on
    the store: {"write_wait": waiting for `writes`, "read": reading entries}).
    """
    rl, grpo, setup = parts.cfg.rl, parts.grpo, parts.setup
    batch = step_batch(parts.cfg, step)
    responses = tasks.responses_from_rollout(roll.tokens, roll.prompt_lengths, roll.lengths)
    rewards = tasks.batch_rewards(batch, responses)
    adv = grpo_advantages(jnp.asarray(rewards), rl.group_size)
    slices = _mini_batches(len(batch), rl.mini_batches)
    if writes and len(writes) != len(slices):
        raise ValueError(f"{len(writes)} pending guidance writes for {len(slices)} mini-batches")
    mini_batches, blocked = [], {"write_wait": 0.0, "read": 0.0}
    for m, rows in enumerate(slices):
        part = roll.rows(rows)
        if setup.capture:  # store -> trainer, version-checked against its trainer's version
            guidance, waited = read_guidance(store, parts, step, m, writes[m] if writes else None)
            r0 = time.perf_counter()
            guidance = parts.on_mesh(guidance, rows.stop - rows.start)
            part = dataclasses.replace(part, guidance=guidance)
            waited["read"] += time.perf_counter() - r0  # host -> device
            for k in blocked:
                blocked[k] += waited[k]
        # PPO's pi_old: the policy at the start of the step, before any mini-batch update, with
        # the guidance as read from the store.
        lp_old = old_logprobs(parts.model, part, setup=setup, grpo=grpo, temperature=rl.temperature)
        mini_batches.append((rows, part, lp_old))
    mismatch = {}
    if reference is not None:
        rows, part, _ = mini_batches[0]
        ref = {k: jax.tree.map(lambda a, r=rows: a[r], g) for k, g in reference.items()}
        stats = site_mismatch(
            parts.model, part, ref, setup=setup, grpo=grpo, temperature=rl.temperature
        )
        mismatch = _mismatch_metrics(stats)
    mb_metrics = [
        grpo_step(
            parts.model,
            parts.optimizer,
            part,
            adv[rows],
            lp_old,
            setup=setup,
            grpo=grpo,
            temperature=rl.temperature,
        )
        for rows, part, lp_old in mini_batches
    ]
    # Mini-batch metrics averaged (each is a mean over its own tokens / sequences).
    metrics = {k: float(np.mean([float(x[k]) for x in mb_metrics])) for k in mb_metrics[0]}
    if not np.isfinite(metrics["loss"]):
        raise FloatingPointError(f"loss is {metrics['loss']} at step {step}")
    metrics = {
        "reward": float(np.mean(rewards)),
        "response_length": float(np.mean(np.asarray(roll.response_mask).sum(-1))),
        **metrics,
        **mismatch,
    }
    return metrics, blocked


def _mismatch_metrics(stats) -> dict[str, float]:
    """Per-site mismatch fractions; over all sites the mismatch and, when there are mismatches,
    the fraction of them one adjacent code apart."""
    out = {}
    n = n_mis = n_one = 0
    for key, st in sorted(stats.items()):
        out[f"mismatch/{key}"] = float(st["mismatch"])
        n, n_mis, n_one = (
            n + int(st["n_elements"]),
            n_mis + int(st["n_mismatch"]),
            n_one + int(st["n_one_apart"]),
        )
    if not n:  # the trainer quantizes nothing (bf16 training, QUADS): no codes to compare
        return out
    out["code_mismatch"] = n_mis / n
    if n_mis:  # undefined without mismatches (and NaN would litter the logs)
        out["one_apart_fraction"] = n_one / n_mis
    return out


def run(cfg, workdir: str, *, stop_after: int | None = None) -> list[dict]:
    """Trains for `cfg.rl.steps` steps (resuming from the last checkpoint); returns the metrics.

    `stop_after` ends this process after that many steps, as if it were killed (tests resume).
    Rollout and training share this process; `experiments/disaggregated.py` runs them apart.
    """
    os.makedirs(workdir, exist_ok=True)
    rl = cfg.rl
    parts = prepare(cfg)
    model, optimizer = parts.model, parts.optimizer
    ckpt = _checkpointer(workdir, rl.checkpoint_every)
    start = 0
    if ckpt.latest_step() is not None:
        start = ckpt.latest_step() + 1
        abstract = {"model": nnx.state(model, nnx.Param), "opt": nnx.state(optimizer)}
        restored = ckpt.restore(ckpt.latest_step(), args=ocp.args.StandardRestore(abstract))
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["opt"])
        logging.info("resumed from step %d", start - 1)
    store = GuidanceStore(GuidanceStoreConfig(kvstore=os.path.join(workdir, "guidance")))
    # What an interrupted attempt did after the checkpoint is redone: drop its guidance entries
    # (the store refuses to overwrite committed ones) and its log rows.
    stale = store.discard_from(parts.run_id, start)
    dropped = {name: drop_rows_from(workdir, name, start) for name in ("rl_metrics", "rl_eval")}
    if stale or any(dropped.values()):
        logging.info(
            "resuming at step %d: dropped %d guidance entries, %s log rows of an "
            "interrupted attempt",
            start,
            len(stale),
            dropped,
        )
    history = []
    with MetricsLog(workdir, "rl_metrics", append=bool(start)) as log, store, parts.mesh_context():
        for step in tqdm(
            range(start, rl.steps), desc=f"rl {rl.method}", initial=start, total=rl.steps
        ):
            version = step * rl.mini_batches
            t0 = time.perf_counter()
            roll, reference = rollout_step(parts, step, reference=mismatch_step(parts, step))
            t1 = time.perf_counter()
            writes = write_guidance(store, parts, roll, step, version)
            t2 = time.perf_counter()
            metrics, blocked = train_step(parts, store, roll, step, reference, writes)
            t3 = time.perf_counter()
            if parts.setup.capture:
                store.flush()  # every write was waited for: nothing left in flight
                store.gc(parts.run_id, step)
            row = {
                **metrics,
                "policy_version": version,
                "max_staleness_used": rl.mini_batches - 1,
                "time_rollout_s": t1 - t0,
                # Time the step was blocked on the store (writes run behind the reward scoring
                # and earlier mini-batches' reads; only the waits count).
                "time_guidance_io_s": t2 - t1 + blocked["write_wait"] + blocked["read"],
                "time_guidance_write_s": t2 - t1 + blocked["write_wait"],  # until committed
                "time_guidance_read_s": blocked["read"],  # store -> host -> device, checked
                "time_train_s": t3 - t2 - blocked["write_wait"] - blocked["read"],
            }
            history.append(log.write(step, row))
            chunk_end = stop_after is not None and step + 1 - start >= stop_after
            ckpt.save(
                step,
                args=ocp.args.StandardSave(
                    {"model": nnx.state(model, nnx.Param), "opt": nnx.state(optimizer)}
                ),
                # The final policy and a chunk's last step are always saved: `checkpoint_every`
                # alone skips them (steps 0..99 every 25 ends at 75, and a resumed chunk would
                # redo the steps after its last multiple).
                force=step == rl.steps - 1 or chunk_end,
            )
            if rl.eval_every and (step + 1) % rl.eval_every == 0:
                _evaluate(model, cfg, parts.setup, step, workdir)
            if chunk_end:
                break
    ckpt.wait_until_finished()
    _plot(workdir)
    return history


def _evaluate(model, cfg, setup, step, workdir) -> None:
    row = {}
    for name in cfg.eval.splits:
        problems = tasks.eval_split(name)[: cfg.eval.problems_per_split]
        row[name] = evaluate_pass_at_1(
            model,
            problems,
            jax.random.key(step),
            k=cfg.eval.k,
            max_new_tokens=cfg.eval.max_new_tokens,
            temperature=cfg.eval.temperature,
            qcfg=setup.rollout_qcfg,
            mode=setup.rollout_mode,
        )
    with MetricsLog(workdir, "rl_eval", append=True) as log:
        row = log.write(step, row)
    logging.info("eval %s", row)


def _plot(workdir: str) -> None:
    path = os.path.join(workdir, "rl_metrics.jsonl")
    rows = read_rows(path)
    if not rows:
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    steps = [r["step"] for r in rows]
    for ax, key, label in zip(
        axes,
        ("reward", "train_rollout_gap_mean", "response_length"),
        ("mean reward", "mean |logp train - rollout|", "response tokens"),
        strict=True,
    ):
        ax.plot(steps, [r[key] for r in rows], "o-", ms=3)
        ax.set(xlabel="RL step", title=label)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "rl_curves.png"), dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "ml_collections config file", lock_config=True)
    flags.DEFINE_string("workdir", "workdir/rl", "checkpoints, guidance store, logs")
    flags.mark_flags_as_required(["config"])
    app.run(main)
