r"""The main job: one SFT start trained by RL with vanilla FP4 QAT and with TRACE, side by side.

  python -m experiments.quickstart --workdir=workdir/quickstart    # configs/quickstart.py
  python -m experiments.quickstart --config.rl.steps=10 --config.rl.eval_every=10 --verbose

Trains the `tiny` MoE on worked solutions once (`trace_jax.rl.sft_or_reuse` into
`<workdir>/sft`), then runs GRPO with NVFP4 rollouts from that checkpoint once per method of
`quickstart.methods` (`trace_jax.rl.RLLoop` into `<workdir>/rl_<method>`): `fp4_qat`
fake-quantizes in the trainer by round-to-nearest, which misses some of the rollout's real FP4
rounding decisions; `trace` replays the rollout's decisions from its compact guidance. Writes
`<workdir>/quickstart.{md,json,png}` and prints the table: per method the smoothed reward of
the first and last steps, the train-rollout log-prob gap, the code mismatch, and pass@1 after
SFT and after RL. Each stage shows a progress bar; third-party INFO logging (orbax, absl) shows
only with `--verbose`. Rerunning reuses the finished stages (an interrupted RL run resumes), and
the notes say which stages were reused from where. A stage made with other settings is refused
(`trace_jax.rl.workdir`: more RL steps and the eval / checkpoint cadence may change); `--fresh`
moves the old workdir aside and starts over.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import matplotlib
import numpy as np
from absl import app

from experiments import harness
from trace_jax.quant import SiteMode
from trace_jax.rl.config_dict import Checks
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.loop import RLLoop
from trace_jax.rl.methods import METHODS
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.sft import SFT_CHECKPOINT, sft_finished, sft_or_reuse
from trace_jax.rl.workdir import move_aside

matplotlib.use("Agg")
import matplotlib.pyplot as plt

GAP, MISMATCH = "train_rollout_gap_mean", "code_mismatch"


def method_summary(rows: Sequence[dict], smooth_steps: int) -> dict[str, float]:
    """What the table reports of one RL run's metric rows (`rl_metrics.jsonl`, in step order).

    Returns "reward_first" and "reward_last" (the mean reward of the first and of the last
    `smooth_steps` rows), "gap" (the mean over rows of `train_rollout_gap_mean`) and, when some
    row measured it, "code_mismatch" (its mean over those rows).
    """
    if not 1 <= smooth_steps <= len(rows):
        raise ValueError(f"smooth_steps={smooth_steps} must be in [1, {len(rows)} rows]")
    reward = [r["reward"] for r in rows]
    out = {
        "reward_first": float(np.mean(reward[:smooth_steps])),
        "reward_last": float(np.mean(reward[-smooth_steps:])),
        "gap": float(np.mean([r[GAP] for r in rows])),
    }
    measured = [r[MISMATCH] for r in rows if MISMATCH in r]
    if measured:
        out["code_mismatch"] = float(np.mean(measured))
    return out


def moving_average(values: Sequence[float], width: int) -> np.ndarray:
    """float64 [len(values) - width + 1]: the mean of each `width` consecutive values (entry i
    ends at value i + width - 1)."""
    if not 1 <= width <= len(values):
        raise ValueError(f"width={width} must be in [1, {len(values)} values]")
    c = np.concatenate([[0.0], np.cumsum(np.asarray(values, np.float64))])
    return (c[width:] - c[:-width]) / width


def _check(config: ExperimentConfig, methods: Sequence[str], smooth_steps: int) -> None:
    """Refuses (`ConfigError`) the settings that cannot give the table, before any stage runs."""
    rl, c = config.rl, Checks("quickstart config")
    unknown = [m for m in methods if m not in METHODS]
    c.need(
        bool(methods) and len(set(methods)) == len(methods) and not unknown,
        "quickstart.methods",
        f"must be distinct registered methods ({sorted(METHODS)}), got {methods}",
    )
    # The SFT stage evaluates bf16 and NVFP4 execution only.
    c.need(rl.format == "nvfp4", "rl.format", f"must be 'nvfp4' (the SFT's), got {rl.format!r}")
    c.need(
        bool(rl.eval_every) and rl.steps % rl.eval_every == 0,
        ("rl.steps", "rl.eval_every"),
        f"disagree: {rl.steps} steps must be a multiple of {rl.eval_every} so that the final "
        "policy is evaluated",
    )
    c.need(
        1 <= smooth_steps <= rl.steps,
        "quickstart.smooth_steps",
        f"must be in [1, rl.steps={rl.steps}], got {smooth_steps}",
    )
    c.raise_any()


def run(cd, workdir: str, *, fresh: bool = False) -> list[dict]:
    """SFT once, then one RL run per method of `cd.quickstart.methods`; writes the artifacts and
    returns the table's rows (one per method). The settings are checked before anything is
    created; `fresh` moves an existing `workdir` aside first."""
    config = ExperimentConfig.from_config_dict(cd)
    methods, smooth = tuple(cd.quickstart.methods), int(cd.quickstart.smooth_steps)
    _check(config, methods, smooth)
    if fresh:
        move_aside(workdir)
    seconds, reused = {}, []
    t0 = time.perf_counter()
    sft_dir = os.path.join(workdir, "sft")
    if sft_finished(sft_dir):
        reused.append(f"SFT reused from {sft_dir}")
    sft_rows, seconds["sft"] = sft_or_reuse(config, sft_dir)
    sft_scores = {r["split"]: r for r in sft_rows}
    rows, curves = [], {}
    for method in methods:
        rl = dataclasses.replace(
            config.rl, method=method, init_from=os.path.join(sft_dir, SFT_CHECKPOINT)
        )
        run_config = dataclasses.replace(config, rl=rl)
        rl_dir = os.path.join(workdir, f"rl_{method}")
        t = time.perf_counter()
        ran = RLLoop(run_config, rl_dir).run()
        seconds[f"rl_{method}"] = time.perf_counter() - t
        if not ran:
            reused.append(f"RL {method} reused from {rl_dir}")
        elif ran[0]["step"] > 0:
            reused.append(f"RL {method} steps 0-{ran[0]['step'] - 1} reused from {rl_dir}")
        metric_rows = read_rows(os.path.join(rl_dir, "rl_metrics.jsonl"))
        final = read_rows(os.path.join(rl_dir, "rl_eval.jsonl"))[-1]
        if final["step"] != rl.steps - 1:
            raise RuntimeError(f"{rl_dir}: the last evaluation is of step {final['step']}")
        # After SFT, the policy scored in the execution this method's rollouts and evaluation use.
        sft_key = (
            "pass@1_bf16" if run_config.method_setup().rollout_mode is SiteMode.OFF
            else "pass@1_nvfp4"
        )  # fmt: skip
        summary = method_summary(metric_rows, smooth)
        row = {
            "method": method,
            f"reward, first {smooth} steps": summary["reward_first"],
            f"reward, last {smooth} steps": summary["reward_last"],
            "train-rollout gap": summary["gap"],
            "code mismatch": summary.get("code_mismatch", "n/a"),
        }
        for split in config.eval.splits:
            row[f"{split} pass@1 after SFT"] = sft_scores[split][sft_key]
            row[f"{split} pass@1 after RL"] = final[split]
        rows.append(row)
        curves[method] = [
            {k: r[k] for k in ("step", "reward", GAP, MISMATCH) if k in r} for r in metric_rows
        ]
    seconds["total"] = time.perf_counter() - t0
    notes = _notes(config, cd.model.preset, smooth, seconds, reused)
    table = harness.write_table(
        "quickstart",
        rows,
        list(rows[0]),
        title="Quickstart: RL of one SFT start with vanilla FP4 QAT and with TRACE",
        notes=notes,
        outdir=workdir,
        extra={"curves": curves, "sft_eval": sft_rows, "seconds": seconds, "reused": reused},
    )
    plot(curves, smooth, os.path.join(workdir, "quickstart.png"))
    print(table)
    print(notes)
    return rows


def _notes(
    config: ExperimentConfig,
    preset: str,
    smooth: int,
    seconds: dict[str, float],
    reused: Sequence[str],
) -> str:
    rl, ev = config.rl, config.eval
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
    # A stage reused from an earlier run of the same settings (`trace_jax.rl.workdir`) is named,
    # with where it was made: its time is not in this run's.
    reuse = f" Reused from an earlier run: {'; '.join(reused)}." if reused else ""
    return (
        f"Model `{preset}` ({config.model.n_layers} blocks); SFT {config.sft.steps} steps of batch "
        f"{config.sft.batch_size} on level {list(config.tasks.levels)} problems of "
        f"{', '.join(config.tasks.kinds)}; then {rl.steps} GRPO steps of {rl.prompts_per_step} "
        f"prompts x {rl.grpo.group_size} samples (temperature {rl.temperature}, learning rate "
        f"{rl.grpo.learning_rate:g}) with {rl.format} W/A/KV rollouts per method. Reward: mean "
        f"over a step's samples, averaged over the first / last {smooth} steps. Train-rollout "
        "gap: mean |log p_train - log p_rollout| over response tokens and steps. Code mismatch: "
        "fraction of FP4 codes at the quantized sites where the trainer's fake quantization "
        f"differs from the rollout's, every {rl.mismatch_every} steps. pass@1: mean over k = "
        f"{ev.k} samples at temperature {ev.temperature} of the first {ev.problems_per_split} "
        "problems of each split (of every task kind the split holds), in the method's rollout "
        f"execution. Time this run: {timing}.{reuse}"
    )


def plot(curves: dict[str, list[dict]], smooth: int, path: str) -> str:
    """Reward (each step, and its `smooth`-step moving average), train-rollout gap and code
    mismatch per RL step, one line per method; saved to `path`."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for i, (method, rows) in enumerate(curves.items()):
        color = f"C{i}"
        steps = [r["step"] for r in rows]
        reward = [r["reward"] for r in rows]
        axes[0].plot(steps, reward, "o", ms=2.5, color=color, alpha=0.35)
        axes[0].plot(steps[smooth - 1 :], moving_average(reward, smooth), color=color, label=method)
        axes[1].plot(steps, [r[GAP] for r in rows], "-", color=color, label=method)
        measured = [(r["step"], r[MISMATCH]) for r in rows if MISMATCH in r]
        if measured:
            axes[2].plot(*zip(*measured, strict=True), "o-", ms=3, color=color, label=method)
    titles = (
        f"reward (dots: per step; line: mean of the last {smooth})",
        "train-rollout gap: mean |logp train - rollout|",
        "code mismatch, trainer vs rollout FP4 codes",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set(xlabel="RL step", title=title)
        ax.title.set_fontsize(9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


main = harness.workdir_main(run)


def define_flags() -> None:
    harness.define_workdir_flags("quickstart", "workdir/quickstart", "where every stage writes")


if __name__ == "__main__":
    define_flags()
    app.run(main)
