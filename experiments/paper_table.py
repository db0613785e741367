r"""One paper-table analog: every (run, seed) of a table config, resumable, then mean +- std.

  python -m experiments.paper_table --config=configs/table1_nvfp4.py --workdir=workdir/table1
  python -m experiments.paper_table --config=configs/table1_nvfp4.py --workdir=workdir/table1 \
      --deadline_s=480        # stop starting new chunks after 8 min; rerun to continue

A table config is an experiment config (see `configs/small_gpu.py`) plus `table`: `name`, `title`,
`seeds`, and `runs`, a list of (label, overrides) where overrides set `rl.*` fields (method,
format, guided_layers). The driver
  1. runs the SFT warm start once (`<workdir>/sft`, reused when present);
  2. runs GRPO for every run and seed from that checkpoint (`<workdir>/<label>/seed<k>`, in chunks
     of `--chunk_steps`; each chunk resumes from the last orbax checkpoint, so a stopped driver
     continues where it was);
  3. when every run is finished, reads each run's final evaluation and writes
     `<outdir>/<name>.{md,json,png}`: pass@1 per split (mean +- std over seeds), the average over
     the benchmark splits, and curves of reward, train-rollout gap and test score.
Nothing is aggregated from unfinished runs: an incomplete table says so and writes nothing.

Parallel workers (e.g. several per GPU: one `small` run leaves an H200 mostly idle): run the SFT
stage once (`--sft_only`), then start workers with `--shard=i/n`; worker i trains the (run, seed)
pairs i, i + n, ... of the table and skips finished ones. A plain run afterwards aggregates:

  python -m experiments.paper_table --config=configs/table1_nvfp4.py --workdir=w --sft_only
  for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$((i % 2)) python -m experiments.paper_table \
      --config=configs/table1_nvfp4.py --workdir=w --shard=$i/4 & done; wait
  python -m experiments.paper_table --config=configs/table1_nvfp4.py --workdir=w
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence

import matplotlib
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import harness, sft
from experiments import main as rl_main
from trace_jax.rl.metrics_log import read_rows

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BENCHMARK_SPLITS = ("aime24", "aime25", "hmmt25", "livecodebench")


def benchmark_splits(splits: Sequence[str]) -> list[str]:
    """The paper's benchmark splits among `splits`: what `average` means in every table (level1
    is the training distribution, not a benchmark)."""
    bench = [s for s in splits if s in BENCHMARK_SPLITS]
    if not bench:
        raise ValueError(
            f"no benchmark split among {list(splits)}: expected some of {BENCHMARK_SPLITS}"
        )
    return bench


def benchmark_average(scores: Mapping[str, float], splits: Sequence[str]) -> float:
    """The mean of `scores` (pass@1 by split) over the benchmark splits among `splits`."""
    return float(np.mean([scores[s] for s in benchmark_splits(splits)]))


def run_dir(workdir: str, label: str, seed: int) -> str:
    """`<workdir>/<label>/seed<k>`, spaces in the label (e.g. "trace mxfp4_w4a4") as "_"."""
    return os.path.join(workdir, label.replace(" ", "_"), f"seed{seed}")


def run_config(cfg, label: str, overrides: dict, seed: int, sft_checkpoint: str):
    """The experiment config of one (run, seed)."""
    c = cfg.copy_and_resolve_references()
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if section != "rl" or field not in c.rl:
            raise ValueError(f"table run {label!r}: unknown override {key!r} (rl.<field> only)")
        c.rl[field] = value
    c.seed = seed
    c.rl.init_from = sft_checkpoint
    return c


def _jsonl(path: str) -> list[dict]:
    return read_rows(path, missing_ok=True)


def steps_done(directory: str) -> int:
    return len({r["step"] for r in _jsonl(os.path.join(directory, "rl_metrics.jsonl"))})


def final_eval(directory: str, steps: int) -> dict | None:
    """The evaluation of the finished policy (at step steps - 1), or None."""
    rows = [r for r in _jsonl(os.path.join(directory, "rl_eval.jsonl")) if r["step"] == steps - 1]
    return rows[-1] if rows else None


def parse_shard(spec: str) -> tuple[int, int]:
    """`"i/n"` -> (i, n) with 0 <= i < n; `""` -> (0, 1) (everything)."""
    if not spec:
        return 0, 1
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like i/n, got {spec!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {spec!r}: need 0 <= i < n")
    return i, n


def table_pairs(
    cfg, shard: tuple[int, int] = (0, 1), labels: tuple[str, ...] = ()
) -> list[tuple[str, dict, int]]:
    """The (label, overrides, seed) pairs that worker `shard = (i, n)` trains, of the runs named
    in `labels` (all runs when empty)."""
    known = [lb for lb, _ in cfg.table.runs]
    if unknown := sorted(set(labels) - set(known)):
        raise ValueError(f"--runs {unknown} are not runs of table {cfg.table.name}: {known}")
    runs = [(lb, ov) for lb, ov in cfg.table.runs if not labels or lb in labels]
    pairs = [(lb, dict(ov), seed) for lb, ov in runs for seed in cfg.table.seeds]
    i, n = shard
    return pairs[i::n]


def train(
    cfg,
    workdir: str,
    *,
    chunk_steps: int,
    deadline_s: float | None,
    shard: tuple[int, int] = (0, 1),
    labels: tuple[str, ...] = (),
) -> bool:
    """Advances this worker's (run, seed) pairs; returns True when they are all finished."""
    t0 = time.perf_counter()
    sft.run_or_reuse(cfg, os.path.join(workdir, "sft"))
    checkpoint = os.path.join(workdir, "sft", "sft_checkpoint")
    for label, overrides, seed in table_pairs(cfg, shard, labels):
        c = run_config(cfg, label, overrides, seed, checkpoint)
        d = run_dir(workdir, label, seed)
        while steps_done(d) < c.rl.steps:
            if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                logging.info("deadline reached; rerun to continue")
                return False
            logging.info("%s seed %d: from step %d", label, seed, steps_done(d))
            rl_main.run(c, d, stop_after=chunk_steps)
    return True


def finished_seeds(cfg, workdir: str, label: str) -> list[int]:
    """The seeds of run `label` with a final evaluation."""
    return [
        s
        for s in cfg.table.seeds
        if final_eval(run_dir(workdir, label, s), cfg.rl.steps) is not None
    ]


def aggregate(cfg, workdir: str, partial: bool = False) -> list[dict]:
    """One row per run: pass@1 mean and std over seeds per split, and the benchmark average.

    `partial`: over the finished seeds only (`seeds` says how many); runs with none are left out.
    Otherwise an unfinished seed is an error."""
    splits = list(cfg.eval.splits)
    rows = []
    for label, overrides in cfg.table.runs:
        finals = []
        for seed in cfg.table.seeds:
            ev = final_eval(run_dir(workdir, label, seed), cfg.rl.steps)
            if ev is None and not partial:
                raise RuntimeError(f"{label} seed {seed} has no final evaluation")
            if ev is not None:
                finals.append(ev)
        if not finals:
            continue
        row = {"run": label, **{k: str(v) for k, v in dict(overrides).items()}}
        for s in splits:
            vals = np.asarray([f[s] for f in finals], np.float64)
            row[s] = float(vals.mean())
            row[f"{s}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else float("nan")
        avg = np.asarray([benchmark_average(f, splits) for f in finals], np.float64)
        row["average"] = float(avg.mean())
        row["average_std"] = float(avg.std(ddof=1)) if len(avg) > 1 else float("nan")
        row["seeds"] = len(finals)
        dirs = [run_dir(workdir, label, sd) for sd in finished_seeds(cfg, workdir, label)]
        row.update(run_statistics([_jsonl(os.path.join(d, "rl_metrics.jsonl")) for d in dirs]))
        rows.append(row)
    return rows


def shared_runs(cfg, workdir: str) -> list[tuple[str, int, str]]:
    """(label, seed, source) of this table's runs whose logs are another table's run
    (`same_run_as.txt`, written by `experiments.table_session`)."""
    out = []
    for label, _ in cfg.table.runs:
        for seed in cfg.table.seeds:
            path = os.path.join(run_dir(workdir, label, seed), "same_run_as.txt")
            if os.path.exists(path):
                with open(path) as f:
                    out.append((label, seed, f.read().strip()))
    return out


STAT_KEYS = ("train_rollout_gap_mean", "train_rollout_kl_k3", "code_mismatch", "one_apart_fraction")


def run_statistics(metrics: list[list[dict]]) -> dict[str, float]:
    """Training-log statistics of one run, over its seeds' `rl_metrics` rows: the mean of each
    `STAT_KEYS` metric over the steps that logged it (code mismatch: the mismatch-measuring
    steps only), averaged over seeds. A metric no step logged is absent (never 0)."""
    out = {}
    for key in STAT_KEYS:
        logged = [[r[key] for r in rows if key in r] for rows in metrics]
        per_seed = [float(np.mean(v)) for v in logged if v]
        if per_seed:
            out[key] = float(np.mean(per_seed))
    return out


def sft_row(cfg, workdir: str, execution: str = "bf16") -> dict | None:
    """The SFT policy's pass@1 per split and benchmark average under `execution` ("bf16", or the
    FP4 format its evaluation ran, e.g. "nvfp4"): where every run starts. None if that
    evaluation is not in the workdir."""
    path = os.path.join(workdir, "sft", "sft_eval.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = json.load(f)["rows"]
    key = f"pass@1_{execution}"
    if key not in rows[0]:
        return None
    by_split = {r["split"]: r[key] for r in rows}
    row = {"run": f"SFT start ({execution})", **{s: float(by_split[s]) for s in cfg.eval.splits}}
    row["average"] = benchmark_average(by_split, cfg.eval.splits)
    return row


def sft_rows(cfg, workdir: str) -> list[dict]:
    """`sft_row` for every execution the SFT evaluation ran (bf16 first)."""
    path = os.path.join(workdir, "sft", "sft_eval.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        first = json.load(f)["rows"][0]
    runs = sorted((k.removeprefix("pass@1_") for k in first if k.startswith("pass@1_")),
                  key=lambda e: e != "bf16")  # fmt: skip
    return [sft_row(cfg, workdir, e) for e in runs]


def adaptation(
    cfg, workdir: str, run: str = "trace", reference: str = "bf16"
) -> dict[str, object] | None:
    """When `run` first matches `reference` on the hardest benchmark split (the one the SFT
    policy scores lowest on; without an SFT evaluation, the one `reference` ends lowest on).

    "Matches" at an evaluation step: `run`'s mean over finished seeds is at least `reference`'s
    mean minus its sample std over seeds. Returns the split, every evaluation step with both
    means, and `matched_at` (None if never); None if either run has no finished seed.
    """
    labels = [lb for lb, _ in cfg.table.runs]
    if run not in labels or reference not in labels:
        return None
    evals = {}
    for label in (run, reference):
        seeds = finished_seeds(cfg, workdir, label)
        if not seeds:
            return None
        evals[label] = [
            _jsonl(os.path.join(run_dir(workdir, label, sd), "rl_eval.jsonl")) for sd in seeds
        ]
    bench = benchmark_splits(cfg.eval.splits)
    start = sft_row(cfg, workdir)
    if start is not None:
        split = min(bench, key=lambda sp: start[sp])
    else:
        split = min(bench, key=lambda sp: np.mean([e[-1][sp] for e in evals[reference]]))
    steps = sorted({r["step"] for e in evals[run] + evals[reference] for r in e})
    points, matched_at = [], None
    for step in steps:
        vals = {
            label: [r[split] for e in evals[label] for r in e if r["step"] == step]
            for label in (run, reference)
        }
        if not all(len(v) == len(evals[lb]) for lb, v in vals.items()):
            continue  # a seed without this evaluation
        ref = np.asarray(vals[reference], np.float64)
        ref_std = float(ref.std(ddof=1)) if len(ref) > 1 else 0.0
        got = float(np.mean(vals[run]))
        points.append({"step": step, run: got, reference: float(ref.mean()), "ref_std": ref_std})
        if matched_at is None and got >= ref.mean() - ref_std:
            matched_at = step
    return {
        "split": split,
        "run": run,
        "reference": reference,
        "points": points,
        "matched_at": matched_at,
    }


def _smooth(x: np.ndarray, window: int = 10) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    c = np.cumsum(np.insert(np.asarray(x, np.float64), 0, 0.0))
    n = np.arange(1, len(x) + 1)
    lo = np.maximum(n - window, 0)
    return (c[n] - c[lo]) / (n - lo)


def plot_adaptation(
    ax, adapt: dict, sft_score: float | None, colors: dict[str, str] | None = None
) -> None:
    """The adaptation curve on `ax`: `adapt`'s run and reference (mean, the reference's seed std
    as error bars) on the hardest split at every evaluation step, from the SFT score (step -1)
    when known; a dotted line where the run first matches. `colors`: label -> matplotlib color."""
    run, ref = adapt["run"], adapt["reference"]
    steps = [p["step"] for p in adapt["points"]]
    run_y = [p[run] for p in adapt["points"]]
    ref_y = [p[ref] for p in adapt["points"]]
    if sft_score is not None:
        steps, run_y, ref_y = [-1, *steps], [sft_score, *run_y], [sft_score, *ref_y]
    ref_err = [0.0] * (len(steps) - len(adapt["points"])) + [p["ref_std"] for p in adapt["points"]]
    colors = colors or {}
    ax.errorbar(
        steps, ref_y, yerr=ref_err, fmt="o-", capsize=3, color=colors.get(ref),
        label=f"{ref} (+- seed std)",
    )  # fmt: skip
    ax.plot(steps, run_y, "s-", color=colors.get(run), label=run)
    if adapt["matched_at"] is not None:
        ax.axvline(adapt["matched_at"], color="k", ls=":", lw=1)
    ax.legend(fontsize=7)
    ax.set(xlabel="RL step", title=f"hardest split `{adapt['split']}` (-1: SFT)")
    ax.grid(True, alpha=0.3)


def _plot(cfg, workdir: str, path: str, adapt: dict | None = None) -> None:
    fig, axes = plt.subplots(1, 4 if adapt else 3, figsize=(18.5 if adapt else 14, 3.6))
    start = sft_row(cfg, workdir)
    sft_score = None if start is None else start["average"]
    for label, _ in cfg.table.runs:
        dirs = [run_dir(workdir, label, s) for s in finished_seeds(cfg, workdir, label)]
        if not dirs:
            continue
        metrics = [_jsonl(os.path.join(d, "rl_metrics.jsonl")) for d in dirs]
        for ax, key in zip(axes[:2], ("reward", "train_rollout_gap_mean"), strict=True):
            steps = [r["step"] for r in metrics[0]]
            vals = np.mean([[r[key] for r in m[: len(steps)]] for m in metrics], axis=0)
            ax.plot(steps, _smooth(vals), label=label)
        evals = [_jsonl(os.path.join(d, "rl_eval.jsonl")) for d in dirs]
        steps = [r["step"] for r in evals[0]]
        score = np.mean(
            [[benchmark_average(r, cfg.eval.splits) for r in e[: len(steps)]] for e in evals], 0
        )
        if sft_score is not None:  # the starting point of every run
            steps, score = [-1, *steps], [sft_score, *score]
        axes[2].plot(steps, score, "o-", label=label)
    for ax, title in zip(
        axes[:3],
        (
            "mean reward (10-step avg)",
            "mean |logp train - rollout| (10-step avg)",
            "test pass@1, benchmark avg (-1: SFT)",
        ),
        strict=True,
    ):
        ax.set(xlabel="RL step", title=title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    if adapt:
        colors = {label: f"C{i}" for i, (label, _) in enumerate(cfg.table.runs)}
        plot_adaptation(axes[3], adapt, None if start is None else start[adapt["split"]], colors)
    fig.suptitle(f"{cfg.table.title}: mean over finished seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    cfg,
    workdir: str,
    *,
    outdir: str,
    chunk_steps: int = 25,
    deadline_s: float | None = None,
    shard: tuple[int, int] = (0, 1),
    labels: tuple[str, ...] = (),
    sft_only: bool = False,
    aggregate_only: bool = False,
    partial: bool = False,
) -> list[dict] | None:
    """Trains what is missing; writes and returns the table once every run is finished.

    `shard = (i, n)` with n > 1: trains worker i's pairs only and writes no table (None);
    `labels`: trains only these runs (all seeds) and writes no table (None);
    `sft_only`: runs (or reuses) the SFT stage and stops (None); `aggregate_only`: trains nothing
    and writes the table from the runs' logs (e.g. brought back from GPU sessions without their
    checkpoints); an unfinished run is an error, unless `partial` (with `aggregate_only`): then
    the table is written over the finished seeds and says so.
    """
    if cfg.rl.steps % cfg.rl.eval_every:
        raise ValueError(
            f"rl.steps={cfg.rl.steps} must be a multiple of rl.eval_every={cfg.rl.eval_every}"
        )
    if sft_only:
        sft.run_or_reuse(cfg, os.path.join(workdir, "sft"))
        return None
    if not aggregate_only:
        done = train(
            cfg, workdir, chunk_steps=chunk_steps, deadline_s=deadline_s, shard=shard, labels=labels
        )
        if not done or shard[1] > 1 or labels:
            return None
    if partial and not aggregate_only:
        raise ValueError("--partial only aggregates (with --aggregate_only)")
    rows = aggregate(cfg, workdir, partial=partial)
    name = cfg.table.name
    cols = ["run", "average", "average_std"]
    cols += [c for s in cfg.eval.splits for c in (s, f"{s}_std")] + ["seeds"]
    table = harness.markdown_table(rows + sft_rows(cfg, workdir), cols, fmt=".3f")
    table += "\n\nTraining-log statistics (means over steps, then seeds; `code_mismatch` and "
    table += "`one_apart_fraction` over the mismatch-measuring steps, every "
    table += f"{cfg.rl.get('mismatch_every', 0)} steps; n/a: the trainer quantizes nothing):\n\n"
    table += harness.markdown_table(rows, ["run", *STAT_KEYS], fmt=".4g")
    notes = (
        f"{cfg.table.title}. Model `{cfg.model.preset}`, SFT warm start {cfg.sft.steps} steps, "
        f"{cfg.rl.steps} GRPO steps of {cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} "
        "samples; pass@1 with each run's own rollout execution (FP4 methods in FP4, `bf16` in "
        f"bf16; the SFT start under both), averaged over k = {cfg.eval.k} samples at temperature "
        f"{cfg.eval.temperature}, {cfg.eval.problems_per_split} problems per split; mean and "
        f"sample std over seeds {list(cfg.table.seeds)}. `average`: mean over "
        f"{benchmark_splits(cfg.eval.splits)}.\n\n![curves]({name}.png)"
    )
    n = len(cfg.table.seeds)
    missing = [f"{r['run']} ({n - r['seeds']} of {n})" for r in rows if r["seeds"] < n]
    missing += [lb for lb, _ in cfg.table.runs if lb not in {r["run"] for r in rows}]
    adapt = adaptation(cfg, workdir)
    if adapt is not None:
        at = adapt["matched_at"]
        pts = ", ".join(
            f"step {p['step']}: {p['trace']:.3f} vs {p['bf16']:.3f} +- {p['ref_std']:.3f}"
            for p in adapt["points"]
        )
        notes += (
            f"\n\nAdaptation: on the hardest split (`{adapt['split']}`, lowest SFT score) `trace` "
            + (f"first matches `bf16` at step {at}" if at is not None else "never matches `bf16`")
            + f" (mean over seeds at least bf16's mean minus its std; {pts})."
        )
    shared = shared_runs(cfg, workdir)
    if shared:
        notes += (
            "\n\nRuns trained once for two tables (the same config and SFT start): "
            + "; ".join(f"`{label}` seed {seed} is `{src}`" for label, seed, src in shared)
            + "."
        )
    if aggregate_only:
        notes = (
            f"Aggregated from the run logs in `{workdir}` (where and when the runs ran: the logs "
            "and that folder's README).\n\n" + notes
        )
    if missing:
        notes = f"**Partial table**: seeds not yet run: {', '.join(missing)}.\n\n" + notes
    harness.write_results(
        name,
        rows,
        title=cfg.table.title,
        table=table,
        notes=notes,
        outdir=outdir,
        extra={"adaptation": adapt} if adapt is not None else None,
    )
    _plot(cfg, workdir, os.path.join(outdir, f"{name}.png"), adapt)
    print(table)
    return rows


def main(argv):
    del argv
    f = flags.FLAGS
    rows = run(
        f.config,
        f.workdir,
        outdir=f.outdir,
        chunk_steps=f.chunk_steps,
        deadline_s=f.deadline_s if f.deadline_s > 0 else None,
        shard=parse_shard(f.shard),
        labels=tuple(f.runs),
        sft_only=f.sft_only,
        aggregate_only=f.aggregate_only,
        partial=f.partial,
    )
    if rows is None and not f.sft_only:
        print("table not written (incomplete, --shard or --runs): rerun without them")


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", None, "table config file", lock_config=True)
    flags.DEFINE_string("workdir", "workdir/table", "runs, checkpoints, guidance stores")
    flags.DEFINE_string("outdir", harness.RESULTS_DIR, "where the table is written")
    flags.DEFINE_integer("chunk_steps", 25, "GRPO steps per resumable chunk")
    flags.DEFINE_float("deadline_s", 0, "stop starting chunks after this many seconds (0: none)")
    flags.DEFINE_string("shard", "", "i/n: train only the (run, seed) pairs i, i+n, ... (workers)")
    flags.DEFINE_list("runs", [], "train only these runs of the table (labels; default: all)")
    flags.DEFINE_bool("sft_only", False, "run (or reuse) the SFT stage and stop")
    flags.DEFINE_bool("aggregate_only", False, "train nothing; write the table from the run logs")
    flags.DEFINE_bool("partial", False, "with --aggregate_only: over the finished seeds only")
    flags.mark_flags_as_required(["config"])
    app.run(main)
