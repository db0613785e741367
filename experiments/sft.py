r"""Supervised warm start on worked solutions, then pass@1 on the held-out splits.

  python -m experiments.sft --config=configs/tiny_cpu.py --workdir=/tmp/trace_tiny
  python -m experiments.sft --config=configs/tiny_cpu.py --config.sft.steps=50 --workdir=/tmp/t

Writes to --workdir: `sft_metrics.jsonl` (one line per logged step; TensorBoard scalars under
`tensorboard/`), `sft_eval.json` and
`sft_eval.md` (pass@1 per split, bf16 and NVFP4 execution), `sft_loss.png`, and the orbax
checkpoint `sft_checkpoint/` (the model's `nnx.Param` state).
"""

from __future__ import annotations

import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags
from tqdm import tqdm

from experiments import harness
from trace_jax import tasks
from trace_jax.models import ModelConfig, init_model
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rl.config import GRPOConfig, make_optimizer
from trace_jax.rl.evaluate import evaluate_pass_at_1
from trace_jax.rl.metrics_log import MetricsLog
from trace_jax.rl.step import sft_step

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def model_config(cfg) -> ModelConfig:
    """The `ModelConfig` named by `cfg.model` (preset + overrides: `init_std`, `grouped_matmul`
    and, when set, `n_layers`)."""
    presets = {"tiny": ModelConfig.tiny, "small": ModelConfig.small}
    if cfg.model.preset not in presets:
        raise ValueError(f"unknown model preset {cfg.model.preset!r}; expected {sorted(presets)}")
    overrides = {}
    if cfg.model.get("n_layers") is not None:  # ModelConfig rejects values below 1
        overrides["n_layers"] = cfg.model.n_layers
    return presets[cfg.model.preset](
        init_std=cfg.model.init_std,
        grouped_matmul=cfg.model.get("grouped_matmul", "ragged_dot"),
        **overrides,
    )


def pad_length(levels) -> int:
    """A fixed SFT row length for these levels (BOS + prompt + solution + EOS), so one compile."""
    caps = [
        tasks.level_spec(t, lv).max_prompt_tokens + tasks.level_spec(t, lv).max_solution_tokens
        for t in tasks.TASKS
        for lv in levels
    ]
    return max(caps) + 2


def save_params(model, path: str) -> None:
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(path), nnx.state(model, nnx.Param), force=True)


def load_params(model, path: str) -> None:
    """Restores `nnx.Param` state saved by `save_params` into `model` (shapes must match)."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.state(model, nnx.Param)
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(os.path.abspath(path), abstract)
    nnx.update(model, restored)


def evaluate(model, cfg, key) -> list[dict]:
    """pass@1 per held-out split, with bf16 and with NVFP4 W/A/KV execution."""
    rows = []
    for name in cfg.eval.splits:
        problems = tasks.eval_split(name)[: cfg.eval.problems_per_split]
        row = {"split": name, "problems": len(problems)}
        for label, qcfg, mode in (
            ("bf16", QuantConfig.bf16(), SiteMode.OFF),
            ("nvfp4", QuantConfig.nvfp4(), SiteMode.RTN),
        ):
            row[f"pass@1_{label}"] = evaluate_pass_at_1(
                model,
                problems,
                jax.random.fold_in(key, len(rows)),
                k=cfg.eval.k,
                max_new_tokens=cfg.eval.max_new_tokens,
                temperature=cfg.eval.temperature,
                qcfg=qcfg,
                mode=mode,
            )
        rows.append(row)
    return rows


def run(cfg, workdir: str) -> list[dict]:
    """Trains, evaluates, checkpoints; returns the evaluation rows."""
    os.makedirs(workdir, exist_ok=True)
    mcfg = model_config(cfg)
    model = init_model(mcfg, seed=cfg.seed)
    opt_cfg = GRPOConfig(
        learning_rate=cfg.sft.learning_rate,
        warmup_steps=cfg.sft.warmup_steps,
        weight_decay=cfg.sft.weight_decay,
    )
    optimizer = nnx.Optimizer(model, make_optimizer(opt_cfg, cfg.sft.steps), wrt=nnx.Param)
    stream = tasks.train_stream(cfg.seed, tasks=cfg.tasks.kinds, levels=cfg.tasks.levels)
    pad_to = pad_length(cfg.tasks.levels)
    if pad_to > 4096:
        raise ValueError(f"SFT rows of {pad_to} tokens are too long")
    history = []
    with MetricsLog(workdir, "sft_metrics") as log:
        bar = tqdm(range(cfg.sft.steps), desc="sft")
        for step in bar:
            batch = tasks.encode_sft_batch(
                list(itertools.islice(stream, cfg.sft.batch_size)), pad_to=pad_to
            )
            metrics = sft_step(
                model,
                optimizer,
                jnp.asarray(batch.tokens),
                jnp.asarray(batch.lengths),
                jnp.asarray(batch.target_mask),
            )
            if step % cfg.sft.log_every == 0 or step == cfg.sft.steps - 1:
                m = {k: float(v) for k, v in metrics.items()}
                if not np.isfinite(m["loss"]):
                    raise FloatingPointError(f"SFT loss is {m['loss']} at step {step}")
                history.append(log.write(step, m))
                bar.set_postfix(nll=f"{m['sft_nll']:.3f}")
    save_params(model, os.path.join(workdir, "sft_checkpoint"))
    rows = evaluate(model, cfg, jax.random.key(cfg.seed + 1))
    table = harness.markdown_table(rows, list(rows[0]))
    harness.write_results(
        "sft_eval",
        rows,
        title="SFT warm start: pass@1 on the held-out splits",
        table=table,
        notes=f"Model preset `{cfg.model.preset}`, {cfg.sft.steps} steps of batch "
        f"{cfg.sft.batch_size}, task levels {list(cfg.tasks.levels)}; greedy decoding, "
        f"k = {cfg.eval.k}.",
        outdir=workdir,
        extra={"history": history},
    )
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([h["step"] for h in history], [h["sft_nll"] for h in history], "o-")
    ax.set(xlabel="step", ylabel="SFT next-token NLL", yscale="log", title="SFT warm start")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "sft_loss.png"), dpi=110)
    plt.close(fig)
    print(table)
    return rows


def run_or_reuse(cfg, workdir: str) -> tuple[list[dict], float]:
    """`run`, unless `workdir` already holds a finished SFT stage: (eval rows, seconds spent)."""
    results = os.path.join(workdir, "sft_eval.json")
    if os.path.exists(os.path.join(workdir, "sft_checkpoint")) and os.path.exists(results):
        logging.info("SFT stage found in %s; reusing it", workdir)
        return json.load(open(results))["rows"], 0.0
    t0 = time.perf_counter()
    rows = run(cfg, workdir)
    return rows, time.perf_counter() - t0


def main(argv):
    del argv
    logging.info("config:\n%s", flags.FLAGS.config)
    run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "ml_collections config file", lock_config=True)
    flags.DEFINE_string("workdir", "workdir/sft", "where checkpoints, logs and results go")
    flags.mark_flags_as_required(["config"])
    app.run(main)
