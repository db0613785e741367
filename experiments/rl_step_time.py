r"""GRPO step time of TRACE against plain FP4 rollouts, split into rollout, guidance I/O, training.

  python -m experiments.rl_step_time --config=configs/small_gpu.py --workdir=/tmp/steptime \
      --methods=trace,fp4_qat --steps=25 --gpus=0,1

Runs each method for `--steps` GRPO steps from the same random initialization (no evaluation, no
mismatch steps: only the steady loop), each alone on its own GPU (`--gpus`, one per method, run
concurrently as subprocesses; without it, one after another in this process), then reports the
median per-step time of each phase over the steps after the first `--skip` (compilation) and the
ratio of each method's step to the first method's reference, `--reference` (default: the last
method, the plain FP4 rollout). The paper: TRACE's step takes +7.4% over plain FP4 rollout.
With `--gpus`, each method's process also records its device's peak memory (`peak_memory_gib`,
where the backend reports it: GPUs do, the CPU does not). Writes `<outdir>/<name>.{md,json,png}`;
`--plot_from=<name>.json` redraws the PNG alone.

From a random initialization no row stops early, so every method samples full-length responses:
equal work per step, which a side-by-side timing needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import matplotlib
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import harness
from experiments import main as rl_main
from experiments.harness import run_workers
from trace_jax.rl.metrics_log import read_rows

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PHASES = ("time_rollout_s", "time_guidance_io_s", "time_train_s")
MEMORY_FILE = "device_memory.json"
GUIDANCE_IO_PARTS = ("time_guidance_write_s", "time_guidance_read_s")


def method_config(cfg, method: str, steps: int):
    """`cfg` for a timing run of `method`: `steps` plain GRPO steps, nothing else timed."""
    c = cfg.copy_and_resolve_references()
    c.rl.update(method=method, steps=steps, eval_every=0, mismatch_every=0, init_from="")
    c.rl.checkpoint_every = steps
    return c


def step_times(rows: Sequence[dict], skip: int) -> dict[str, float]:
    """Median seconds per phase and in all over the steps after the first `skip`."""
    steady = [r for r in rows if r["step"] >= skip]
    if not steady:
        raise ValueError(f"no steps after the first {skip} to time (got {len(rows)} steps)")
    out = {k: float(np.median([r[k] for r in steady])) for k in PHASES}
    out["time_step_s"] = float(np.median([sum(r[k] for k in PHASES) for r in steady]))
    for k in GUIDANCE_IO_PARTS:  # logged since 2026-11-30
        if all(k in r for r in steady):
            out[k] = float(np.median([r[k] for r in steady]))
    out["steps_timed"] = len(steady)
    out["reward"] = float(np.mean([r["reward"] for r in steady]))
    return out


def report(workdir: str, methods: Sequence[str], skip: int, reference: str) -> list[dict]:
    """One row per method from its `rl_metrics.jsonl`: phase medians, guidance I/O share of the
    step, and the step time relative to `reference`'s."""
    rows = []
    for m in methods:
        logged = read_rows(os.path.join(workdir, m, "rl_metrics.jsonl"))
        rows.append({"method": m, **step_times(logged, skip)})
        memory = os.path.join(workdir, m, MEMORY_FILE)
        if os.path.exists(memory):
            with open(memory) as f:
                rows[-1]["peak_memory_gib"] = json.load(f)["peak_bytes_in_use"] / 2**30
    ref = next(r for r in rows if r["method"] == reference)
    for r in rows:
        r["guidance_io_share"] = r["time_guidance_io_s"] / r["time_step_s"]
        r["step_vs_reference"] = r["time_step_s"] / ref["time_step_s"]
    return rows


def run_method(cfg, workdir: str, method: str, steps: int, record_memory: bool = False) -> None:
    """Runs `method`; with `record_memory` (a process of its own), writes the device's peak
    memory over the run to `<workdir>/<method>/device_memory.json` where the backend has it."""
    rl_main.run(method_config(cfg, method, steps), os.path.join(workdir, method))
    stats = jax.local_devices()[0].memory_stats() if record_memory else None
    if stats and "peak_bytes_in_use" in stats:
        with open(os.path.join(workdir, method, MEMORY_FILE), "w") as f:
            json.dump({"peak_bytes_in_use": int(stats["peak_bytes_in_use"])}, f)


def plot(rows: Sequence[dict], path: str) -> None:
    """One stacked bar per method: median rollout, guidance I/O (the write still committing and
    the read, where logged) and training seconds of a GRPO step."""
    parts = [("time_rollout_s", "rollout")]
    if all(k in r for r in rows for k in GUIDANCE_IO_PARTS):
        parts += [("time_guidance_write_s", "guidance write (waited for)")]
        parts += [("time_guidance_read_s", "guidance read")]
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
    ax.set(yticks=y, yticklabels=[r["method"] for r in rows], xlabel="seconds per GRPO step")
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
    cfg,
    *,
    workdir: str,
    methods: Sequence[str],
    steps: int,
    skip: int = 2,
    reference: str = "",
    gpus: Sequence[str] = (),
    outdir: str = harness.RESULTS_DIR,
    name: str = "rl_step_time",
) -> list[dict]:
    reference = reference or methods[-1]
    if reference not in methods:
        raise ValueError(f"--reference {reference!r} is not among --methods {list(methods)}")
    if steps <= skip:
        raise ValueError(f"--steps={steps} leaves no step after the first --skip={skip}")
    if gpus:
        if len(gpus) != len(methods):
            raise ValueError(f"{len(methods)} methods need {len(methods)} --gpus, got {gpus}")
        failed = run_workers("experiments.rl_step_time", "worker_method", methods, gpus)
        if failed:
            raise RuntimeError(f"timing runs failed: {failed}")
    else:
        for m in methods:
            run_method(cfg, workdir, m, steps)
    rows = report(workdir, methods, skip, reference)
    cols = ["method", *PHASES, *GUIDANCE_IO_PARTS, "time_step_s", "guidance_io_share"]
    cols += ["step_vs_reference"]
    cols += ["steps_timed", "reward"]
    cols += ["peak_memory_gib"] if all("peak_memory_gib" in r for r in rows) else []
    placement = "each alone on its own GPU, concurrently" if gpus else "one after another"
    notes = (
        f"Model `{cfg.model.preset}` from random initialization, {cfg.rl.prompts_per_step} prompts "
        f"x {cfg.rl.group_size} samples of {cfg.rl.max_new_tokens} new tokens, "
        f"{cfg.rl.mini_batches} mini-batches; {steps} steps per method ({placement}), medians "
        f"over the steps after the first {skip} (compilation). `step_vs_reference`: step time "
        f"over `{reference}`'s (paper: TRACE +7.4% over plain FP4 rollout).\n\n"
        f"![step time by phase]({name}.png)"
    )
    harness.write_results(
        name,
        rows,
        title="GRPO step time: TRACE vs plain FP4 rollout",
        table=harness.markdown_table(rows, cols),
        notes=notes,
        outdir=outdir,
    )
    plot(rows, os.path.join(outdir, f"{name}.png"))
    print(harness.markdown_table(rows, cols))
    return rows


def main(argv):
    del argv
    f = flags.FLAGS
    if f.plot_from:
        print(f"wrote {plot_from(f.plot_from)}")
        return
    if f.config is None:
        raise app.UsageError("--config is required (or --plot_from)")
    if f.worker_method:  # a subprocess of --gpus: one method's run, no report
        run_method(f.config, f.workdir, f.worker_method, f.steps, record_memory=True)
        return
    logging.info("timing %s", f.methods)
    run(
        f.config,
        workdir=f.workdir,
        methods=f.methods,
        steps=f.steps,
        skip=f.skip,
        reference=f.reference,
        gpus=f.gpus,
        outdir=f.outdir,
        name=f.name,
    )


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "experiment config", lock_config=False)
    flags.DEFINE_string("workdir", "workdir/rl_step_time", "one run directory per method")
    flags.DEFINE_list("methods", ["trace", "fp4_qat"], "methods to time")
    flags.DEFINE_integer("steps", 25, "GRPO steps per method")
    flags.DEFINE_integer("skip", 2, "first steps left out of the medians (compilation)")
    flags.DEFINE_string("reference", "", "the method others are compared to (default: the last)")
    flags.DEFINE_list("gpus", [], "one GPU per method: run them concurrently, each alone on one")
    flags.DEFINE_string("worker_method", "", "internal: run this one method (a --gpus subprocess)")
    flags.DEFINE_string("outdir", harness.RESULTS_DIR, "where results are written")
    flags.DEFINE_string("name", "rl_step_time", "result file stem")
    flags.DEFINE_string("plot_from", "", "only redraw the PNG of this written JSON")
    app.run(main)
