"""Table 7 analog: a BF16-trained policy quantized after training vs TRACE's final FP4 policy.

The BF16-trained policy's routed-expert weights are quantized once with each recipe of
`trace_jax.quant.ptq` (vanilla NVFP4, 4over6, H-Scale calibrated on training prompts of the
config's tasks), then evaluated with FP4 execution: NVFP4 W/A/KV, the quantized weights passed
through unchanged (`QuantConfig(weights_prequantized=True)`), activations and KV quantized on
the fly as in the rollout. Beside them: the BF16 policy with bf16 execution and, if given,
TRACE's final policy with its own FP4 execution (RTN weights, as its rollout ran). Scores are
pass@1 per held-out split and their benchmark average (`grid.benchmark_average`).

A policy is an RL workdir (its final step's checkpoint) or parameters saved by
`trace_jax.rl.checkpoint.save_params`. Each training seed's rows are kept in
`<outdir>/<name>_seeds/seed<k>.json` as soon as they are computed (`seed_rows`), the BF16
policy's and TRACE's apart, each with the policy path it came from: a rerun reuses every part
computed from the same policy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import data
from trace_jax.models import init_model
from trace_jax.quant import QuantConfig, SiteMode, ptq
from trace_jax.rl.checkpoint import checkpoint_manager, load_params
from trace_jax.rl.evaluate import EvalSuite, pass_at_1_by_split
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.loop import RLLoop, step_problems
from trace_jax.tables.grid import benchmark_average
from trace_jax.tasks.splits import with_current_split_names

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PTQTableConfig:
    """The `ptq` section of the Table 7 config.

    calibration_prompts: training prompts whose activation statistics calibrate H-Scale.
    """

    calibration_prompts: int = 64

    def __post_init__(self):
        if self.calibration_prompts < 1:
            raise ValueError(f"calibration_prompts={self.calibration_prompts} must be >= 1")


def load_policy(config: ExperimentConfig, path: str) -> nnx.Module:
    """The policy at `path`: an RL workdir's final checkpoint (step `config.rl.steps - 1`; an
    unfinished run is refused before anything is restored) or saved parameters."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no policy at {path} (an RL workdir or saved params)")
    checkpoints = os.path.join(path, "rl_checkpoints")
    if os.path.isdir(checkpoints):
        manager = checkpoint_manager(checkpoints, 1)
        step = manager.latest_step()
        manager.close()
        if step != config.rl.steps - 1:
            raise ValueError(
                f"{path}: the latest checkpoint is step {step}, not the final step "
                f"{config.rl.steps - 1}: the run is unfinished; its final policy cannot be "
                "evaluated"
            )
        with RLLoop(config, path) as loop:  # the run's model and optimizer, then restored
            loop.restore()
        return loop.model
    model = init_model(config.model, seed=config.seed)
    load_params(model, path)
    return model


def scores(config: ExperimentConfig, model, qcfg: QuantConfig | None, mode: SiteMode) -> dict:
    """pass@1 of `model` per held-out split of `config.eval` under (qcfg, mode) (split i sampled
    with the key `seed + i`), and `average` over the benchmark splits."""
    suite = EvalSuite.from_config(config)
    keys = [jax.random.key(config.seed + i) for i in range(len(suite.splits))]
    row = pass_at_1_by_split(model, suite, keys, qcfg=qcfg, mode=mode)
    return {**row, "average": benchmark_average(row, suite.splits)}


def calibration_batch(config: ExperimentConfig, n_prompts: int) -> tuple[jax.Array, jax.Array]:
    """Training prompts (never held-out problems; steps no RL run reaches) as tokens int32
    [n, P] and their valid mask bool [n, P]."""
    problems = []
    step = 0
    while len(problems) < n_prompts:
        problems += step_problems(config, 10_000_000 + step, n_prompts)
        step += 1
    prompts, lengths = data.encode_prompts(
        problems[:n_prompts], tokenizer=config.tasks.make_tokenizer()
    )
    valid = jnp.arange(prompts.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
    return jnp.asarray(prompts), valid


def bf16_policy_rows(
    config: ExperimentConfig, bf16_policy: str, calibration_prompts: int
) -> list[dict]:
    """One seed's BF16-trained policy: in bf16, then with each PTQ recipe and FP4 execution
    (with `weight_sq_error`, the summed squared error of the routed-expert weights)."""
    policy = load_policy(config, bf16_policy)
    bf16 = scores(config, policy, None, SiteMode.OFF)
    rows = [{"policy": "BF16-trained, bf16 execution", **bf16}]
    stats = ptq.calibration_stats(policy, *calibration_batch(config, calibration_prompts))
    prequantized = QuantConfig.nvfp4(weights_prequantized=True)
    for recipe in ptq.RECIPES:
        model = nnx.clone(policy)
        errors = ptq.quantize_model_experts(model, recipe, stats)
        row = {"policy": f"BF16-trained + {recipe} PTQ, FP4 execution"}
        row.update(scores(config, model, prequantized, SiteMode.RTN))
        row["weight_sq_error"] = sum(errors.values())
        rows.append(row)
        log.info("%s", row)
    return rows


def trace_policy_row(config: ExperimentConfig, trace_policy: str) -> dict:
    """One seed's TRACE final policy with its own FP4 execution (RTN weights, as it rolled out)."""
    model = load_policy(config, trace_policy)
    row = scores(config, model, QuantConfig.nvfp4(), SiteMode.RTN)
    return {"policy": "TRACE final policy, FP4 execution", **row}


def policy_pairs(bf16_policies: Sequence[str], trace_policies: Sequence[str]) -> list:
    """(BF16 policy, TRACE policy or "") per training seed."""
    if not bf16_policies:
        raise ValueError("give at least one BF16-trained policy")
    if trace_policies and len(trace_policies) != len(bf16_policies):
        raise ValueError(
            f"{len(bf16_policies)} BF16 policies but {len(trace_policies)} TRACE policies: "
            "give one TRACE policy per seed, or none"
        )
    return list(zip(bf16_policies, list(trace_policies) or [""] * len(bf16_policies), strict=True))


def seed_rows_path(outdir: str, name: str, seed: int) -> str:
    return os.path.join(outdir, f"{name}_seeds", f"seed{seed}.json")


def seed_rows(
    config: ExperimentConfig,
    outdir: str,
    name: str,
    seed: int,
    bf16_policy: str,
    trace_policy: str,
    calibration_prompts: int,
) -> list[dict]:
    """Seed `seed`'s rows: the BF16 policy's (`bf16_policy_rows`) then, if given, TRACE's
    (`trace_policy_row`). Each part is kept in the seed's file as soon as it is computed and
    reused when the file holds it for the same policy (and calibration): an interrupted table
    resumes, and the BF16 part can be evaluated while the TRACE policies still train. Rows
    kept under older split names are read under the current ones."""
    path = seed_rows_path(outdir, name, seed)
    saved = {}
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
    parts = [
        (
            "bf16",
            {"policy": bf16_policy, "calibration_prompts": calibration_prompts},
            lambda: bf16_policy_rows(config, bf16_policy, calibration_prompts),
        )
    ]
    if trace_policy:
        parts.append(
            ("trace", {"policy": trace_policy}, lambda: [trace_policy_row(config, trace_policy)])
        )
    rows = []
    for part, source, compute in parts:
        if saved.get(part, {}).get("source") == source:
            log.info("seed %d: reusing its %s rows from %s", seed, part, path)
        else:
            saved[part] = {"source": source, "rows": compute()}
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(saved, f, indent=1)
            os.replace(path + ".tmp", path)  # a seed's file is whole or absent
        rows += [with_current_split_names(r) for r in saved[part]["rows"]]
    return rows


def over_seeds(per_seed: Sequence[list[dict]]) -> list[dict]:
    """Rows of several seeds (same policies in the same order) -> mean, sample std (`<key>_std`)
    and the per-seed values (`<key>_seeds`) of every number; `seeds` says how many."""
    out = []
    for rows in zip(*per_seed, strict=True):
        row = {"policy": rows[0]["policy"], "seeds": len(rows)}
        for key in [k for k in rows[0] if k != "policy"]:
            vals = np.asarray([r[key] for r in rows], np.float64)
            row[key] = float(vals.mean())
            row[f"{key}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else float("nan")
            row[f"{key}_seeds"] = vals.tolist()
        out.append(row)
    return out
