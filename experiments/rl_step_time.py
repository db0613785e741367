r"""GRPO step time of TRACE against plain FP4 rollouts, split into rollout, guidance I/O, training.

  python -m experiments.rl_step_time --workdir=/tmp/steptime            # one GPU, in turn
  python -m experiments.rl_step_time --workdir=/tmp/steptime --gpus=0,1
  python -m experiments.rl_step_time --config=configs/rl_step_time.py:smoke \
      --workdir=/tmp/steptime_smoke --outdir=/tmp/steptime_smoke       # CPU: every stage

Runs each method of `step_time.methods` (`configs/rl_step_time.py`: the `small` preset) for
`step_time.steps` GRPO steps from the same random initialization (no evaluation, no mismatch
steps: only the steady loop), each alone on its own GPU (`--gpus`, one per method, run
concurrently as subprocesses; without it, one after another in this process), then reports the
median per-step time of each phase over the steps after the first `step_time.skip`
(compilation) and the ratio of each method's step to the reference method's
(`step_time.reference`, default: the last method, the plain FP4 rollout), with the kernels each
rollout ran (`rollout_implementation`: `rl.rollout_implementation`, "auto" = the Pallas kernels
on a GPU). The paper: TRACE's step takes +7.4% over plain FP4 rollout. With `--gpus`, each
method's process also records its device's peak memory (`peak_memory_gib`, where the backend
reports it: GPUs do, the CPU does not). Writes `<outdir>/<name>.{md,json,png}`;
`--plot_from=<name>.json` redraws the PNG alone. `--config.step_time.profile_steps=N` runs N more
steps of each method, the same run's (so compiled already), under `jax.profiler` into
`<workdir>/<method>/profile` (not in the medians): which kernels a steady step runs and where the
host leaves the device idle.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib
import numpy as np
from absl import app, flags

from experiments import harness
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.logs import quiet_third_party
from trace_jax.tables import step_time
from trace_jax.tables.step_time import GUIDANCE_IO_PARTS, PHASES, StepTimeConfig

matplotlib.use("Agg")
import matplotlib.pyplot as plt

IO_LABELS = {
    "time_guidance_write_s": "guidance write (waited for)",
    "time_guidance_read_s": "guidance read",
    "time_guidance_delete_wait_s": "guidance deletion (waited for)",
}


def plot(rows: Sequence[dict], path: str) -> None:
    """One stacked bar per method (labelled with its rollout's kernels where recorded): median
    rollout, guidance I/O (the write still committing, the read and the wait for the previous
    step's deletion, where logged) and training seconds of a GRPO step."""
    parts = [("time_rollout_s", "rollout")]
    logged = [k for k in GUIDANCE_IO_PARTS if all(k in r for r in rows)]
    if logged[:2] == list(GUIDANCE_IO_PARTS[:2]):
        parts += [(k, IO_LABELS[k]) for k in logged]
    else:
        parts += [("time_guidance_io_s", "guidance I/O")]
    parts += [("time_train_s", "training")]
    fig, ax = plt.subplots(figsize=(7, 1.6 + 0.55 * len(rows)))
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for i, (key, label) in enumerate(parts):
        width = np.array([r[key] for r in rows])
        ax.barh(y, width, left=left, color=f"C{i}", label=label)
        left += width
    for yi, r in zip(y, rows, strict=True):
        label = f" {r['time_step_s']:.3f} s ({r['step_vs_reference']:.2f}x)"
        ax.text(left[yi], yi, label, va="center")
    # Rows of older result files lack the rollout's kernels.
    labels = [f"{r['method']} ({r.get('rollout_implementation', '?')})" for r in rows]
    ax.set(yticks=y, yticklabels=labels, xlabel="seconds per GRPO step")
    ax.set_xlim(0, 1.3 * left.max())
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(parts))
    ax.set_title("GRPO step time by phase (medians)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_from(path: str) -> str:
    """Redraws `<name>.png` beside a written `<name>.json`; returns the PNG's path."""
    required = ("method", *PHASES, "time_step_s", "step_vs_reference")
    rows = harness.rows_written_by(path, "experiments.rl_step_time", required)
    out = os.path.splitext(path)[0] + ".png"
    plot(rows, out)
    return out


def run(
    config: ExperimentConfig,
    timing: StepTimeConfig,
    *,
    workdir: str,
    gpus: Sequence[str] = (),
    outdir: str = harness.RESULTS_DIR,
    name: str = "rl_step_time",
) -> list[dict]:
    """Times every method (in `gpus` subprocesses, one GPU each, or one after another here) and
    writes the report; returns its rows (`trace_jax.tables.step_time.report`)."""
    methods, reference = timing.methods, timing.reference_method
    if gpus:
        if len(gpus) != len(methods):
            raise ValueError(f"{len(methods)} methods need {len(methods)} --gpus, got {gpus}")
        failed = harness.run_workers("experiments.rl_step_time", "worker_method", methods, gpus)
        if failed:
            raise RuntimeError(f"timing runs failed: {failed}")
    else:
        for m in methods:
            step_time.run_method(
                config, workdir, m, timing.steps, profile_steps=timing.profile_steps
            )
    rows = step_time.report(workdir, methods, timing.skip, reference, steps=timing.steps)
    cols = ["method", "rollout_implementation", *PHASES, *GUIDANCE_IO_PARTS, "time_step_s"]
    cols += ["guidance_io_share"]
    cols += ["step_vs_reference", "steps_timed", "reward"]
    cols += ["peak_memory_gib"] if all("peak_memory_gib" in r for r in rows) else []
    placement = "each alone on its own GPU, concurrently" if gpus else "one after another"
    rl = config.rl
    notes = (
        f"{config.model.n_layers}-layer model from random initialization, {rl.prompts_per_step} "
        f"prompts x {rl.grpo.group_size} samples of {rl.max_new_tokens} new tokens, "
        f"{rl.grpo.mini_batches} mini-batches; {timing.steps} steps per method ({placement}), "
        f"medians over the steps after the first {timing.skip} (compilation). "
        f"`rollout_implementation`: the rollout's kernels (`rl.rollout_implementation="
        f"{rl.rollout_implementation}`). `step_vs_reference`: step time over `{reference}`'s "
        f"(paper: TRACE +7.4% over plain FP4 rollout).\n\n![step time by phase]({name}.png)"
    )
    table = harness.write_table(
        name, rows, cols, title="GRPO step time: TRACE vs plain FP4 rollout", notes=notes,
        outdir=outdir,
    )  # fmt: skip
    plot(rows, os.path.join(outdir, f"{name}.png"))
    print(table)
    return rows


def main(argv):
    del argv
    f = flags.FLAGS
    quiet_third_party(f.verbose)
    if f.plot_from:
        print(f"wrote {plot_from(f.plot_from)}")
        return
    config = ExperimentConfig.from_config_dict(f.config)
    timing = from_section(StepTimeConfig, f.config.step_time)
    if f.worker_method:  # a subprocess of --gpus: one method's run, no report
        step_time.run_method(
            config,
            f.workdir,
            f.worker_method,
            timing.steps,
            record_memory=True,
            profile_steps=timing.profile_steps,
        )
        return
    run(config, timing, workdir=f.workdir, gpus=f.gpus, outdir=f.outdir, name=f.name)


if __name__ == "__main__":
    harness.define_config_flag("rl_step_time")
    flags.DEFINE_string("workdir", "workdir/rl_step_time", "one run directory per method")
    flags.DEFINE_list("gpus", [], "one GPU per method: run them concurrently, each alone on one")
    flags.DEFINE_string("worker_method", "", "internal: run this one method (a --gpus subprocess)")
    harness.define_result_flags("rl_step_time")
    flags.DEFINE_string("plot_from", "", "only redraw the PNG of this written JSON")
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl)")
    app.run(main)
