r"""Table 7 analog: a BF16-trained policy quantized after training vs TRACE's final FP4 policy.

  python -m experiments.ptq_table --config=configs/table7_ptq.py \
      --bf16_policy=<bf16 run seed 0>,<seed 1>,... --trace_policy=<trace run seed 0>,...

(a policy is an RL workdir, whose latest checkpoint is used, or parameters saved by
`experiments.sft.save_params`).

The BF16-trained policy's routed-expert weights are quantized once with each recipe of
`trace_jax.quant.ptq` (vanilla NVFP4, 4over6, H-Scale calibrated on `--calibration_prompts`
training prompts of the config's tasks), then evaluated with FP4 execution: NVFP4 W/A/KV, the
quantized weights passed through unchanged (`QuantConfig(weights_prequantized=True)`),
activations and KV quantized on the fly as in the rollout. Beside them: the BF16 policy with bf16
execution and, if given, TRACE's final policy with its own FP4 execution (RTN weights, as its
rollout ran). pass@1 per held-out split and their mean; the summed squared weight error of each
recipe. Writes <outdir>/<name>.{md,json}.

Each seed's rows are also written to `<outdir>/<name>_seeds/seed<k>.json` as soon as they are
computed, the BF16 policy's and TRACE's apart, each with the policy path it came from: a rerun
reuses every part computed from the same policy (an interrupted table resumes; a first run with
the BF16 policies only can start while the TRACE policies still train). `--gpus=0,1` evaluates
the seeds in parallel subprocesses, seed k on GPU `gpus[k % len(gpus)]`, then merges their
files. `average`: the benchmark splits' mean, as in every table (`paper_table.benchmark_average`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from experiments import harness, paper_table, sft
from experiments import main as rl_main
from experiments.harness import run_workers
from trace_jax import tasks
from trace_jax.models import init_model
from trace_jax.quant import QuantConfig, SiteMode, ptq
from trace_jax.rl.evaluate import evaluate_pass_at_1

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load_policy(cfg, path: str):
    """A policy from an RL workdir (its final step's checkpoint: anything else is refused) or
    from saved params."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no policy at {path} (an RL workdir or saved params)")
    if os.path.isdir(os.path.join(path, "rl_checkpoints")):
        mngr = rl_main._checkpointer(path, 1)
        if (step := mngr.latest_step()) != cfg.rl.steps - 1:
            raise ValueError(
                f"{path}: the latest checkpoint is step {step}, not the final step "
                f"{cfg.rl.steps - 1}: the run is unfinished (or trained before the final step "
                "was always saved); its final policy cannot be evaluated"
            )
        parts = rl_main.prepare(cfg)
        abstract = {"model": nnx.state(parts.model, nnx.Param), "opt": nnx.state(parts.optimizer)}
        restored = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
        nnx.update(parts.model, restored["model"])
        return parts.model
    model = init_model(sft.model_config(cfg), seed=cfg.seed)
    sft.load_params(model, path)
    return model


def _scores(cfg, model, qcfg, mode) -> dict[str, float]:
    row = {}
    for i, split in enumerate(cfg.eval.splits):
        problems = tasks.eval_split(split)[: cfg.eval.problems_per_split]
        row[split] = evaluate_pass_at_1(
            model,
            problems,
            jax.random.key(cfg.seed + i),
            k=cfg.eval.k,
            max_new_tokens=cfg.eval.max_new_tokens,
            temperature=cfg.eval.temperature,
            qcfg=qcfg,
            mode=mode,
        )
    row["average"] = paper_table.benchmark_average(row, cfg.eval.splits)
    return row


def calibration_batch(cfg, n_prompts: int) -> tuple[jax.Array, jax.Array]:
    """Training prompts (not held-out problems) as tokens [n, P] and their valid mask."""
    problems = []
    step = 0
    while len(problems) < n_prompts:
        problems += rl_main._problems(cfg, 10_000_000 + step, n_prompts)
        step += 1
    prompts, lengths = tasks.encode_prompts(problems[:n_prompts])
    valid = jnp.arange(prompts.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
    return jnp.asarray(prompts), valid


def bf16_policy_rows(cfg, bf16_policy: str, calibration_prompts: int = 64) -> list[dict]:
    """One seed's BF16-trained policy: in bf16, then with each PTQ recipe and FP4 execution."""
    policy = load_policy(cfg, bf16_policy)
    rows = [{"policy": "BF16-trained, bf16 execution", **_scores(cfg, policy, None, SiteMode.OFF)}]
    tokens, valid = calibration_batch(cfg, calibration_prompts)
    stats = ptq.calibration_stats(policy, tokens, valid)
    for recipe in ptq.RECIPES:
        model = nnx.clone(policy)
        errors = ptq.quantize_model_experts(model, recipe, stats)
        prequantized = QuantConfig.nvfp4(weights_prequantized=True)
        row = {"policy": f"BF16-trained + {recipe} PTQ, FP4 execution"}
        row.update(_scores(cfg, model, prequantized, SiteMode.RTN))
        row["weight_sq_error"] = sum(errors.values())
        rows.append(row)
        logging.info("%s", row)
    return rows


def trace_policy_row(cfg, trace_policy: str) -> dict:
    """One seed's TRACE final policy with its own FP4 execution (RTN weights, as it rolled out)."""
    model = load_policy(cfg, trace_policy)
    scores = _scores(cfg, model, QuantConfig.nvfp4(), SiteMode.RTN)
    return {"policy": "TRACE final policy, FP4 execution", **scores}


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


def seed_rows_path(outdir: str, name: str, seed: int) -> str:
    return os.path.join(outdir, f"{name}_seeds", f"seed{seed}.json")


def seed_rows(
    cfg, outdir: str, name: str, seed: int, bf16_policy: str, trace_policy: str, calibration: int
) -> list[dict]:
    """Seed `seed`'s rows: the BF16 policy's (`bf16_policy_rows`) then, if given, TRACE's
    (`trace_policy_row`). Each part is kept in the seed's file as soon as it is computed and
    reused when the file holds it for the same policy (and calibration): an interrupted table
    resumes, and the BF16 part can be evaluated while the TRACE policies still train."""
    path = seed_rows_path(outdir, name, seed)
    saved = {}
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
    parts = [
        (
            "bf16",
            {"policy": bf16_policy, "calibration_prompts": calibration},
            lambda: bf16_policy_rows(cfg, bf16_policy, calibration),
        )
    ]
    if trace_policy:
        parts.append(
            ("trace", {"policy": trace_policy}, lambda: [trace_policy_row(cfg, trace_policy)])
        )
    rows = []
    for part, source, compute in parts:
        if saved.get(part, {}).get("source") == source:
            logging.info("seed %d: reusing its %s rows from %s", seed, part, path)
        else:
            saved[part] = {"source": source, "rows": compute()}
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(saved, f, indent=1)
            os.replace(path + ".tmp", path)  # a seed's file is whole or absent
        rows += saved[part]["rows"]
    return rows


def plot(rows: Sequence[dict], path: str) -> None:
    """pass@1 x100 per benchmark split and their average: one group of bars per split, one bar
    per policy (mean over seeds, sample std as error bar, each seed a dot). `rows` as written by
    `run` (with `<key>_seeds`)."""
    keys = [k for k in (*paper_table.BENCHMARK_SPLITS, "average") if f"{k}_seeds" in rows[0]]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(keys), 3.8))
    for i, row in enumerate(rows):
        x = np.arange(len(keys)) + (i - (len(rows) - 1) / 2) * width
        mean = [100 * row[k] for k in keys]
        std = [100 * np.nan_to_num(row[f"{k}_std"]) for k in keys]
        ax.bar(x, mean, width, yerr=std, capsize=2, color=f"C{i}", label=row["policy"])
        for xi, k in zip(x, keys, strict=True):
            seeds = [100 * v for v in row[f"{k}_seeds"]]
            ax.plot([xi] * len(seeds), seeds, ".", color="k", ms=3)
    lo = min(100 * v for r in rows for k in keys for v in r[f"{k}_seeds"])
    ax.set(xticks=np.arange(len(keys)), xticklabels=keys, ylabel="pass@1 x100", ylim=(lo - 8, None))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title("Table 7 analog: post-training FP4 quantization vs TRACE", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_from(path: str) -> str:
    """Redraws `<table>.png` beside a written `<table>.json` (its policies may be gone); returns
    the PNG's path."""
    rows = harness.rows_written_by(path, "experiments.ptq_table", ("policy", "average_seeds"))
    out = os.path.splitext(path)[0] + ".png"
    plot(rows, out)
    return out


def run(
    cfg,
    *,
    bf16_policies: Sequence[str],
    trace_policies: Sequence[str] = (),
    calibration_prompts: int = 64,
    outdir: str = harness.RESULTS_DIR,
    name: str = "table7_ptq",
    gpus: Sequence[str] = (),
    worker_seed: int | None = None,
) -> list[dict]:
    """The table over seeds: `bf16_policies[k]` and `trace_policies[k]` (if given) are the
    final policies of training seed k. `gpus`: evaluate the seeds in parallel subprocesses;
    `worker_seed`: (such a subprocess) evaluate that seed only, write its file, no table."""
    if not bf16_policies:
        raise ValueError("give at least one BF16-trained policy")
    if trace_policies and len(trace_policies) != len(bf16_policies):
        raise ValueError(
            f"{len(bf16_policies)} BF16 policies but {len(trace_policies)} TRACE policies: "
            "give one TRACE policy per seed, or none"
        )
    traces = list(trace_policies) or [""] * len(bf16_policies)
    pairs = list(zip(bf16_policies, traces, strict=True))
    if worker_seed is not None:
        return seed_rows(cfg, outdir, name, worker_seed, *pairs[worker_seed], calibration_prompts)
    if gpus:
        if failed := run_workers("experiments.ptq_table", "worker_seed", range(len(pairs)), gpus):
            raise RuntimeError(f"PTQ evaluation of seeds {failed} failed")
    per_seed = [
        seed_rows(cfg, outdir, name, k, b, t, calibration_prompts) for k, (b, t) in enumerate(pairs)
    ]
    rows = over_seeds(per_seed)
    columns = ["policy", "average", "average_std", *cfg.eval.splits, "weight_sq_error", "seeds"]
    notes = (
        f"pass@1 (k={cfg.eval.k}, {cfg.eval.problems_per_split} problems per split, "
        f"temperature {cfg.eval.temperature}), mean over {len(per_seed)} training seeds "
        "(`average_std`: sample std over seeds; every split's std and per-seed values are in the "
        f"JSON); H-Scale calibrated on {calibration_prompts} training prompts; weight_sq_error: "
        "summed squared error of the routed-expert weights.\n\n"
        f"![pass@1 by policy]({name}.png)"
    )
    harness.write_results(
        name,
        rows,
        title="Table 7 analog: post-training FP4 quantization vs TRACE",
        table=harness.markdown_table(rows, columns),
        notes=notes,
        outdir=outdir,
    )
    plot(rows, os.path.join(outdir, f"{name}.png"))
    return rows


def main(argv):
    del argv
    f = flags.FLAGS
    if f.plot_from:
        print(f"wrote {plot_from(f.plot_from)}")
        return
    if not f.config or not f.bf16_policy:
        raise app.UsageError("--config and --bf16_policy are required (or --plot_from)")
    run(
        f.config,
        bf16_policies=f.bf16_policy,
        trace_policies=f.trace_policy,
        calibration_prompts=f.calibration_prompts,
        outdir=f.outdir,
        name=f.name,
        gpus=f.gpus,
        worker_seed=None if f.worker_seed < 0 else f.worker_seed,
    )


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "ml_collections config file", lock_config=True)
    flags.DEFINE_list("bf16_policy", None, "BF16-trained policies, one per seed (RL workdirs)")
    flags.DEFINE_list("trace_policy", [], "TRACE's final policies, one per seed (optional)")
    flags.DEFINE_integer("calibration_prompts", 64, "training prompts for H-Scale's statistics")
    flags.DEFINE_string("outdir", harness.RESULTS_DIR, "where the table is written")
    flags.DEFINE_string("name", "table7_ptq", "result file stem")
    flags.DEFINE_list("gpus", [], "evaluate the seeds in parallel, seed k on gpus[k % len(gpus)]")
    flags.DEFINE_integer("worker_seed", -1, "internal: evaluate this seed only (a --gpus worker)")
    flags.DEFINE_string("plot_from", "", "only redraw <table>.png from this written <table>.json")
    app.run(main)
