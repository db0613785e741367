r"""Supervised warm start on worked solutions, then pass@1 on the held-out splits.

  python -m experiments.sft --config=configs/tiny_cpu.py --workdir=/tmp/trace_tiny
  python -m experiments.sft --config=configs/tiny_cpu.py --config.sft.steps=50 --workdir=/tmp/t

Runs `trace_jax.rl.run_sft` (it writes `sft_metrics.jsonl`, `sft_checkpoint/` and
`sft_eval.json` to --workdir), then writes `sft_eval.{json,md}` with provenance and
`sft_loss.png`, and prints the table.
"""

from __future__ import annotations

import os

import matplotlib
from absl import app, flags

from experiments import harness
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.logs import quiet_third_party
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.sft import run_sft

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


def main(argv):
    del argv
    quiet_third_party(flags.FLAGS.verbose)
    cd, workdir = flags.FLAGS.config, flags.FLAGS.workdir
    rows = run_sft(ExperimentConfig.from_config_dict(cd), workdir)
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


def define_flags() -> None:
    harness.define_config_flag("tiny_cpu")
    flags.DEFINE_string("workdir", "workdir/sft", "where checkpoints, logs and results go")
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
