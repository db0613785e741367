r"""Supervised warm start on worked solutions, then pass@1 on the held-out splits.

  python -m experiments.sft --config=configs/tiny_cpu.py --workdir=/tmp/trace_tiny
  python -m experiments.sft --config=configs/tiny_cpu.py --config.sft.steps=50 --workdir=/tmp/t

Runs `trace_jax.rl.run_sft` (it writes `sft_metrics.jsonl`, `sft_checkpoint/`, `sft_eval.json`
and `sft_config.json` to --workdir), then writes `sft_eval.{json,md}` with provenance and
`sft_loss.png`, and prints the table. A bad setting is refused before anything is created; a
workdir holding an SFT stage of other settings is refused unless `--fresh` moves it aside first.
"""

from __future__ import annotations

import os

import matplotlib
from absl import app

from experiments import harness
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.sft import run_sft
from trace_jax.rl.workdir import move_aside

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_loss(workdir: str) -> str:
    """`<workdir>/sft_loss.png`: the logged SFT next-token NLL per step; its path."""
    history = read_rows(os.path.join(workdir, "sft_metrics.jsonl"))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([h["step"] for h in history], [h["sft_nll"] for h in history], "o-")
    ax.set(xlabel="step", ylabel="SFT next-token NLL", yscale="log", title="SFT warm start")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = os.path.join(workdir, "sft_loss.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(cd, workdir: str, *, fresh: bool = False) -> list[dict]:
    """SFT of the experiment ConfigDict `cd` in `workdir` (after moving an existing one aside
    when `fresh`), then its result files and loss plot; returns the evaluation rows. The
    settings are checked before anything is created."""
    config = ExperimentConfig.from_config_dict(cd)
    if fresh:
        move_aside(workdir)
    rows = run_sft(config, workdir)
    table = harness.write_table(
        "sft_eval",
        rows,
        list(rows[0]),
        title="SFT warm start: pass@1 on the held-out splits",
        notes=f"Model preset `{cd.model.preset}`, {cd.sft.steps} steps of batch "
        f"{cd.sft.batch_size}, task levels {list(cd.tasks.levels)}; k = {cd.eval.k} samples "
        f"at temperature {cd.eval.temperature}.",
        outdir=workdir,
        extra={"history": read_rows(os.path.join(workdir, "sft_metrics.jsonl"))},
    )
    plot_loss(workdir)
    print(table)
    return rows


main = harness.workdir_main(run)


def define_flags() -> None:
    harness.define_workdir_flags("tiny_cpu", "workdir/sft", "checkpoints, logs and results")


if __name__ == "__main__":
    define_flags()
    app.run(main)
