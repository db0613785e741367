"""Supervised warm start on worked solutions, then pass@1 on the held-out sets.

  rows = run_sft(ExperimentConfig.from_config_dict(cd), workdir)

Writes into `workdir`: `sft_metrics.jsonl` (a row every `sft.log_every` steps and at the last;
TensorBoard scalars under `tensorboard/`), the orbax checkpoint `sft_checkpoint/` (the model's
`nnx.Param` state: what `rl.init_from` names), `sft_eval.json` (`{"rows": [...],
"params_fingerprint": ...}`: pass@1 per held-out set with bf16 and with NVFP4 W/A/KV execution,
and a digest of the trained parameters' bits, `checkpoint.params_fingerprint`) and the stage's
settings `sft_config.json` (`trace_jax.rl.workdir`: a workdir of an SFT stage with other
settings is refused, never retrained over or reused).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from trace_jax import data
from trace_jax.models import Qwen3MoE
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rl.checkpoint import params_fingerprint, save_params
from trace_jax.rl.config import GRPOConfig, make_optimizer
from trace_jax.rl.evaluate import EvalSuite, pass_at_1_by_split
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.metrics_log import MetricsLog
from trace_jax.rl.step import sft_step
from trace_jax.rl.workdir import guard_workdir
from trace_jax.rl.workers import initial_model

log = logging.getLogger(__name__)

SFT_CHECKPOINT = "sft_checkpoint"
SFT_EVAL = "sft_eval.json"
# In `SFT_EVAL`: `checkpoint.params_fingerprint` of the trained parameters.
FINGERPRINT_KEY = "params_fingerprint"
# In an RL run's directory: a copy of the `SFT_EVAL` of the stage the run started from, so that
# the run's start stays on record wherever its logs go (`trace_jax.tables.train.record_start`).
SFT_START = "sft_start.json"
MAX_ROW_TOKENS = 4096


def evaluate_sft(model: Qwen3MoE, config: ExperimentConfig, key: jax.Array) -> list[dict]:
    """Rows `{"split", "problems", "pass@1_bf16", "pass@1_nvfp4"}`: pass@1 per held-out set
    (`EvalSuite`) with bf16 and with NVFP4 W/A/KV execution (set i sampled with `fold_in(key, i)`
    in both)."""
    suite = EvalSuite.from_config(config)
    keys = [jax.random.fold_in(key, i) for i in range(len(suite.splits))]
    scores = {
        label: pass_at_1_by_split(model, suite, keys, qcfg=qcfg, mode=mode)
        for label, qcfg, mode in (
            ("bf16", QuantConfig.bf16(), SiteMode.OFF),
            ("nvfp4", QuantConfig.nvfp4(), SiteMode.RTN),
        )
    }
    return [
        {
            "split": name,
            "problems": len(suite.sets[name]),
            **{f"pass@1_{label}": s[name] for label, s in scores.items()},
        }
        for name in suite.splits
    ]


def run_sft(config: ExperimentConfig, workdir: str) -> list[dict]:
    """Trains `config.sft.steps` steps from a fresh `config.model` (`model.hf_dir`'s weights when
    set) on the worked solutions of the training dataset (`config.tasks`), checkpoints it,
    evaluates it; returns the evaluation rows (`evaluate_sft`). Raises FloatingPointError on a
    non-finite logged loss, and before any work (ValueError) when the examples carry no worked
    solutions or the tokenizer's ids do not fit the model, then (`WorkdirConfigError`) when
    `workdir` holds an SFT stage of other settings."""
    sft = config.sft
    tokenizer = config.tasks.make_tokenizer()
    data.check_vocab(tokenizer, config.model.vocab_size)
    dataset = config.tasks.make_dataset()
    pad_to = dataset.sft_row_length(tokenizer)
    if pad_to > MAX_ROW_TOKENS:
        raise ValueError(f"SFT rows of {pad_to} tokens exceed {MAX_ROW_TOKENS}")
    guard_workdir(workdir, "sft", config)
    model = initial_model(config, None)  # `model.hf_dir`'s weights when set
    opt_cfg = GRPOConfig(
        learning_rate=sft.learning_rate,
        warmup_steps=sft.warmup_steps,
        weight_decay=sft.weight_decay,
    )
    optimizer = nnx.Optimizer(model, make_optimizer(opt_cfg, sft.steps), wrt=nnx.Param)
    stream = dataset.stream(config.seed)
    with MetricsLog(workdir, "sft_metrics") as metrics_log:
        bar = tqdm(range(sft.steps), desc="sft")
        for step in bar:
            batch = data.encode_sft_batch(
                list(itertools.islice(stream, sft.batch_size)), pad_to=pad_to, tokenizer=tokenizer
            )
            metrics = sft_step(
                model,
                optimizer,
                jnp.asarray(batch.tokens),
                jnp.asarray(batch.lengths),
                jnp.asarray(batch.target_mask),
            )
            if step % sft.log_every == 0 or step == sft.steps - 1:
                m = {k: float(v) for k, v in metrics.items()}
                if not np.isfinite(m["loss"]):
                    raise FloatingPointError(f"SFT loss is {m['loss']} at step {step}")
                metrics_log.write(step, m)
                bar.set_postfix(nll=f"{m['sft_nll']:.3f}")
    save_params(model, os.path.join(workdir, SFT_CHECKPOINT))
    rows = evaluate_sft(model, config, jax.random.key(config.seed + 1))
    with open(os.path.join(workdir, SFT_EVAL), "w") as f:
        json.dump({"rows": rows, FINGERPRINT_KEY: params_fingerprint(model)}, f, indent=1)
    return rows


def sft_finished(workdir: str) -> bool:
    """Whether `workdir` holds a finished SFT stage: its checkpoint and its `sft_eval.json`."""
    return all(os.path.exists(os.path.join(workdir, n)) for n in (SFT_CHECKPOINT, SFT_EVAL))


def sft_or_reuse(config: ExperimentConfig, workdir: str) -> tuple[list[dict], float]:
    """`run_sft`, unless `workdir` already holds a finished SFT stage (`sft_finished`) of these
    settings: returns (the evaluation rows, seconds spent: 0 when reused). A finished stage of
    other SFT settings (or of none recorded) raises `WorkdirConfigError`."""
    if sft_finished(workdir):
        guard_workdir(workdir, "sft", config)
        log.info("SFT stage found in %s; reusing it", workdir)
        with open(os.path.join(workdir, SFT_EVAL)) as f:
            return json.load(f)["rows"], 0.0
    t0 = time.perf_counter()
    rows = run_sft(config, workdir)
    return rows, time.perf_counter() - t0
