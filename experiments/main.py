r"""GRPO with FP4 rollouts and any registered method, on one process or several; resumable.

  python -m experiments.main --config=configs/tiny_cpu.py --workdir=/tmp/trace_tiny \
      --config.rl.init_from=/tmp/trace_tiny/sft_checkpoint --config.rl.method=trace

  # Two processes of two CPU devices each, one 4-device mesh (the same command with
  # --process_id=1 in a second shell; on a TPU pod or under SLURM: --coordinator=auto):
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m experiments.main \
      --config=configs/tiny_cpu.py --workdir=/tmp/trace_mp --config.mesh.data=4 \
      --coordinator=localhost:12355 --num_processes=2 --process_id=0

Runs `trace_jax.rl.RLLoop` (what it writes to --workdir: `trace_jax/rl/loop.py`), then plots
`rl_curves.png` (reward, train-rollout log-prob gap, response length per step). With
`--coordinator`, every process runs this program on one mesh over all their devices
(`trace_jax.distributed`); process 0 writes the files. Rerun the same
command to resume after a kill. A bad setting is refused before anything is created; a workdir
made with other settings is refused (`trace_jax.rl.workdir`: more steps and the eval /
checkpoint cadence may change) unless `--fresh` moves it aside first.
"""

from __future__ import annotations

import os

import matplotlib
from absl import app

from experiments import harness
from trace_jax.distributed import is_primary, on_primary
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.loop import RLLoop
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.workdir import move_aside

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CURVES = (
    ("reward", "mean reward"),
    ("train_rollout_gap_mean", "mean |logp train - rollout|"),
    ("response_length", "response tokens"),
)


def plot_curves(workdir: str) -> str | None:
    """`<workdir>/rl_curves.png` from `rl_metrics.jsonl` (nothing without rows); its path."""
    rows = read_rows(os.path.join(workdir, "rl_metrics.jsonl"), missing_ok=True)
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(CURVES), figsize=(12, 3.2))
    steps = [r["step"] for r in rows]
    for ax, (key, label) in zip(axes, CURVES, strict=True):
        ax.plot(steps, [r[key] for r in rows], "o-", ms=3)
        ax.set(xlabel="RL step", title=label)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = os.path.join(workdir, "rl_curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(cd, workdir: str, *, fresh: bool = False) -> list[dict]:
    """The RL run of the experiment ConfigDict `cd` in `workdir` (after moving an existing one
    aside when `fresh`), then its curves; returns the metric rows of the steps it ran. The
    settings are checked before anything is created."""
    config = ExperimentConfig.from_config_dict(cd)
    if fresh:
        on_primary(lambda: move_aside(workdir), "moving the workdir aside")
    history = RLLoop(config, workdir).run()
    if is_primary():
        plot_curves(workdir)
    return history


main = harness.workdir_main(run)


def define_flags() -> None:
    harness.define_workdir_flags("tiny_cpu", "workdir/rl", "checkpoints, guidance store, logs")
    harness.define_distributed_flags()


if __name__ == "__main__":
    define_flags()
    app.run(main)
