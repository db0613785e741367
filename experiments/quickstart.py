r"""The whole loop at CPU scale: SFT warm start, a short RL run, evaluation, a table and a plot.

  python -m experiments.quickstart --config=configs/tiny_cpu.py --workdir=workdir/quickstart

Runs `experiments.sft` into `<workdir>/sft`, then `experiments.main` (the config's RL method,
TRACE by default, with FP4 rollouts) from that checkpoint into `<workdir>/rl`, evaluating pass@1
after SFT (bf16 and NVFP4 execution) and after RL (the method's rollout execution). Writes
`<workdir>/quickstart.{md,json,png}` and prints the table. Rerunning resumes the RL run from its
last checkpoint (the SFT stage is skipped when its checkpoint exists).
"""

from __future__ import annotations

import os
import time

import matplotlib
from absl import app, flags
from ml_collections import config_flags

from experiments import harness, sft
from experiments import main as rl_main
from trace_jax.rl.metrics_log import read_rows

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _final_rl_eval(workdir: str) -> dict:
    path = os.path.join(workdir, "rl_eval.jsonl")
    if not os.path.exists(path):
        raise RuntimeError(f"the RL run wrote no evaluation ({path}); set rl.eval_every")
    return read_rows(path)[-1]


def run(cfg, workdir: str) -> list[dict]:
    """Runs SFT, RL and both evaluations; returns one row per split."""
    if cfg.rl.steps % cfg.rl.eval_every:
        raise ValueError(
            f"rl.steps={cfg.rl.steps} must be a multiple of rl.eval_every={cfg.rl.eval_every} "
            "so that the final policy is evaluated"
        )
    sft_dir, rl_dir = os.path.join(workdir, "sft"), os.path.join(workdir, "rl")
    sft_rows, sft_s = sft.run_or_reuse(cfg, sft_dir)
    rl_cfg = cfg.copy_and_resolve_references()
    rl_cfg.rl.init_from = os.path.join(sft_dir, "sft_checkpoint")
    t0 = time.perf_counter()
    history = rl_main.run(rl_cfg, rl_dir)
    rl_s = time.perf_counter() - t0
    after = _final_rl_eval(rl_dir)
    method = cfg.rl.method
    rows = [
        {
            "split": r["split"],
            "problems": r["problems"],
            "SFT pass@1 (bf16)": r["pass@1_bf16"],
            "SFT pass@1 (NVFP4)": r["pass@1_nvfp4"],
            f"after {cfg.rl.steps} RL steps ({method}, {cfg.rl.format})": after[r["split"]],
        }
        for r in sft_rows
    ]
    notes = (
        f"Model `{cfg.model.preset}`; SFT {cfg.sft.steps} steps ({sft_s:.0f} s this run), RL "
        f"{cfg.rl.steps} steps of {cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} samples "
        f"({rl_s:.0f} s this run); task levels {list(cfg.tasks.levels)}; greedy pass@1. "
        "`level1` is in-distribution; the other splits (levels 2-4) are beyond a model this size."
    )
    harness.write_results(
        "quickstart",
        rows,
        title="Quickstart: SFT warm start, then RL with FP4 rollouts",
        table=harness.markdown_table(rows, list(rows[0])),
        notes=notes,
        outdir=workdir,
        extra={"rl_history": history, "sft_seconds": sft_s, "rl_seconds": rl_s},
    )
    _plot(rows, rl_dir, os.path.join(workdir, "quickstart.png"))
    print(harness.markdown_table(rows, list(rows[0])))
    print(notes)
    return rows


def _plot(rows: list[dict], rl_dir: str, path: str) -> None:
    metrics = read_rows(os.path.join(rl_dir, "rl_metrics.jsonl"))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    ax1.plot([m["step"] for m in metrics], [m["reward"] for m in metrics], "o-", ms=3)
    ax1.set(xlabel="RL step", ylabel="mean reward", title="RL reward")
    ax1.grid(True, alpha=0.3)
    cols = [c for c in rows[0] if c not in ("split", "problems")]
    width = 0.8 / len(cols)
    for i, col in enumerate(cols):
        ax2.bar([j + i * width for j in range(len(rows))], [r[col] for r in rows], width, label=col)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["split"] for r in rows])
    ax2.set(ylabel="pass@1", title="held-out splits")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "ml_collections config file", lock_config=True)
    flags.DEFINE_string("workdir", "workdir/quickstart", "where every stage writes")
    flags.mark_flags_as_required(["config"])
    app.run(main)
