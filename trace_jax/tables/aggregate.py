"""A table from its runs' logs: pass@1 mean +- std over seeds, log statistics, curves.

Everything here reads run logs only (`rl_metrics.jsonl`, `rl_eval.jsonl`, each run's
`sft_start.json`, else the table's `sft/sft_eval.json`), so a table is rebuilt from logs brought
back without checkpoints; evaluations are read under the current split names, also from logs
written under older ones. Nothing is aggregated from an
unfinished run: `aggregate` raises, or with `partial` leaves the unfinished seeds out and says
how many seeds each row has.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from trace_jax.quant import SiteMode
from trace_jax.rl.evaluate import BF16_SUFFIX
from trace_jax.rl.methods import get_method
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.sft import FINGERPRINT_KEY, SFT_EVAL, SFT_START
from trace_jax.tables.grid import Table, benchmark_average, benchmark_splits, run_dir, sft_dir
from trace_jax.tables.train import eval_rows, final_eval, finished_seeds
from trace_jax.tasks.splits import with_current_split_names

# Training-log statistics of a table's runs (`run_statistics`).
STAT_KEYS = (
    "train_rollout_gap_mean",
    "train_rollout_kl_k3",
    "train_rollout_kl_per_response",
    "code_mismatch",
    "one_apart_fraction",
)
# Derived per step: the per-token KL times the step's mean response length, the train-rollout
# KL of a whole response (nats; the sequence-level mismatch that grows with length).
KL_PER_RESPONSE = ("train_rollout_kl_per_response", "train_rollout_kl_k3", "response_length")
# The benchmark average of a run's policies run in bf16 (FP4 runs with `eval.in_bf16_too`).
AVERAGE_BF16 = "average" + BF16_SUFFIX


def _log(directory: str, name: str) -> list[dict]:
    return read_rows(os.path.join(directory, f"{name}.jsonl"), missing_ok=True)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof 1; nan for one value)."""
    v = np.asarray(values, np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else float("nan")


def run_statistics(metrics: Sequence[Sequence[dict]]) -> dict[str, float]:
    """Training-log statistics of one run from its seeds' `rl_metrics` rows: the mean of each
    `STAT_KEYS` metric over the steps that logged it (code mismatch: the mismatch-measuring
    steps only; the KL per response where a step logged both its factors, `KL_PER_RESPONSE`),
    averaged over seeds. A metric no step logged is absent (never 0)."""
    out = {}
    derived, kl, length = KL_PER_RESPONSE
    metrics = [[{**r, derived: r[kl] * r[length]} if kl in r and length in r else r for r in rows]
               for rows in metrics]  # fmt: skip
    for key in STAT_KEYS:
        logged = [[r[key] for r in rows if key in r] for rows in metrics]
        per_seed = [float(np.mean(v)) for v in logged if v]
        if per_seed:
            out[key] = float(np.mean(per_seed))
    return out


def aggregate(table: Table, workdir: str, partial: bool = False) -> list[dict]:
    """One row per run: `run`, its overrides (as strings), pass@1 mean and `<split>_std` over
    seeds per split, the benchmark `average` (+ `average_std`), `seeds` (how many), the
    `run_statistics` of its logs, and `AVERAGE_BF16` (+ `_std`) where every final evaluation
    also scored the policy in bf16.

    An unfinished seed is a RuntimeError; with `partial`, the row is over the finished seeds and
    runs without any are left out."""
    splits = list(table.experiment.eval.splits)
    rows = []
    for label, overrides in table.runs:
        finals, dirs = [], []
        for seed in table.seeds:
            d = run_dir(workdir, label, seed)
            ev = final_eval(d, table.steps(label))
            if ev is None and not partial:
                raise RuntimeError(f"{label} seed {seed} has no final evaluation in {d}")
            if ev is not None:
                finals.append(ev)
                dirs.append(d)
        if not finals:
            continue
        row = {"run": label, **{k: str(v) for k, v in overrides.items()}}
        for s in splits:
            row[s], row[f"{s}_std"] = _mean_std([f[s] for f in finals])
        row["average"], row["average_std"] = _mean_std(
            [benchmark_average(f, splits) for f in finals]
        )
        row["seeds"] = len(finals)
        if all(s + BF16_SUFFIX in f for f in finals for s in splits):
            # FP4 runs evaluated in bf16 as well (`EvalConfig.in_bf16_too`)
            row[AVERAGE_BF16], row[f"{AVERAGE_BF16}_std"] = _mean_std(
                [benchmark_average({s: f[s + BF16_SUFFIX] for s in splits}, splits) for f in finals]
            )
        row.update(run_statistics([_log(d, "rl_metrics") for d in dirs]))
        rows.append(row)
    return rows


def paired_differences(table: Table, workdir: str, reference: str = "bf16") -> list[dict]:
    """Each run against `reference`, seed by seed: over the seeds both finished (a seed's runs
    start from one SFT stage, also when seeds ran on different machines), the mean and sample
    std of the run's final benchmark `average` minus `reference`'s, `seeds` (how many) and, where
    every such final evaluation also scored the policy in bf16, the same for that score
    (`AVERAGE_BF16`) minus `reference`'s average. Empty without `reference` in the table."""
    if reference not in table.labels:
        return []
    splits = table.experiment.eval.splits

    def finals(label: str) -> dict[int, dict]:
        out = {s: final_eval(run_dir(workdir, label, s), table.steps(label)) for s in table.seeds}
        return {s: ev for s, ev in out.items() if ev is not None}

    ref = finals(reference)
    rows = []
    for label in table.labels:
        own = finals(label)
        seeds = sorted(set(own) & set(ref))
        if label == reference or not seeds:
            continue
        base = [benchmark_average(ref[s], splits) for s in seeds]
        own_avg = [benchmark_average(own[s], splits) for s in seeds]
        key = f"average - {reference}"
        row = {"run": label, "seeds": len(seeds)}
        row[key], row[f"{key}_std"] = _mean_std(np.subtract(own_avg, base))
        if all(sp + BF16_SUFFIX in own[s] for s in seeds for sp in splits):
            in_bf16 = [
                benchmark_average({sp: own[s][sp + BF16_SUFFIX] for sp in splits}, splits)
                for s in seeds
            ]
            key = f"{AVERAGE_BF16} - {reference}"
            row[key], row[f"{key}_std"] = _mean_std(np.subtract(in_bf16, base))
        rows.append(row)
    return rows


def _start_path(workdir: str, label: str, seed: int) -> str:
    """The SFT evaluation run `label`'s seed `seed` started from: its `SFT_START` record, else
    (a run from before that record) the table's `sft/sft_eval.json`; either may not exist."""
    path = os.path.join(run_dir(workdir, label, seed), SFT_START)
    return path if os.path.exists(path) else os.path.join(sft_dir(workdir), SFT_EVAL)


def _start_scores(workdir: str, label: str, seed: int) -> dict | None:
    """`_start_path`'s evaluation as `{split: {execution: pass@1}}`; None without one."""
    path = _start_path(workdir, label, seed)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = [with_current_split_names(r) for r in json.load(f)["rows"]]
    return {
        r["split"]: {k.removeprefix("pass@1_"): v for k, v in r.items() if k.startswith("pass@1_")}
        for r in rows
    }


EXECUTION_GAP_KEYS = ("gap at end", "gap at start", "widened")


def execution_gaps(table: Table, workdir: str) -> list[dict]:
    """What FP4 execution costs each FP4 run's policy, seed by seed: the final benchmark average
    of the policy run in bf16 minus run in the run's format ("gap at end"), the same for the SFT
    policy the seed started from ("gap at start"), and their difference ("widened": whether RL in
    FP4 widened the gap); mean and sample std (`<key>_std`) over the seeds whose final evaluation
    scored the policy in bf16 and whose start was evaluated in both, and `seeds`. Runs without
    such seeds (bf16 runs among them) have no row."""
    splits = table.experiment.eval.splits
    rows = []
    for label in table.labels:
        fmt = run_execution(table, label)
        gaps = []
        for seed in table.seeds:
            final = final_eval(run_dir(workdir, label, seed), table.steps(label))
            start = _start_scores(workdir, label, seed)
            if fmt == "bf16" or final is None or start is None:
                continue
            if not all(sp + BF16_SUFFIX in final and {"bf16", fmt} <= set(start[sp])
                       for sp in splits):  # fmt: skip
                continue
            end = benchmark_average({sp: final[sp + BF16_SUFFIX] - final[sp] for sp in splits},
                                    splits)  # fmt: skip
            at_start = benchmark_average(
                {sp: start[sp]["bf16"] - start[sp][fmt] for sp in splits}, splits
            )
            gaps.append((end, at_start, end - at_start))
        if gaps:
            row = {"run": label, "seeds": len(gaps)}
            for key, values in zip(EXECUTION_GAP_KEYS, np.transpose(gaps), strict=True):
                row[key], row[f"{key}_std"] = _mean_std(values)
            rows.append(row)
    return rows


def missing_seeds(table: Table, rows: Sequence[dict]) -> list[str]:
    """`"<run> (<missing> of <seeds>)"` for each run of `aggregate(partial=True)`'s rows short of
    seeds, and the labels of runs without a row."""
    n = len(table.seeds)
    missing = [f"{r['run']} ({n - r['seeds']} of {n})" for r in rows if r["seeds"] < n]
    return missing + [lb for lb in table.labels if lb not in {r["run"] for r in rows}]


def _sft_evals(table: Table, workdir: str) -> list[list[dict]]:
    """The SFT evaluations (rows per split) where the table's finished runs started, one per
    distinct start (by fingerprint, in seed order): each run's `SFT_START`; for runs without
    that record, the table's `sft/sft_eval.json`. Empty when there is none."""
    records, table_sft = {}, os.path.join(sft_dir(workdir), SFT_EVAL)
    done = {label: finished_seeds(table, workdir, label) for label in table.labels}
    for seed in table.seeds:
        for label in table.labels:
            if seed not in done[label]:
                continue
            path = _start_path(workdir, label, seed)
            if os.path.exists(path):
                with open(path) as f:
                    record = json.load(f)
                records.setdefault(record.get(FINGERPRINT_KEY, path), record)
    if not records and os.path.exists(table_sft):  # a table without finished runs yet
        with open(table_sft) as f:
            records[table_sft] = json.load(f)
    return [[with_current_split_names(r) for r in rec["rows"]] for rec in records.values()]


def sft_row(table: Table, workdir: str, execution: str = "bf16") -> dict | None:
    """The SFT policy's pass@1 per split and benchmark average under `execution` ("bf16", or the
    FP4 format its evaluation ran, e.g. "nvfp4"): where the runs start. Runs of different seeds
    may start from different SFT stages (machines); the row is then the mean over those starts
    and says how many. None if no such evaluation is recorded."""
    evals = _sft_evals(table, workdir)
    key = f"pass@1_{execution}"
    if not evals or any(key not in rows[0] for rows in evals):
        return None
    splits = table.experiment.eval.splits
    per_start = [{r["split"]: r[key] for r in rows} for rows in evals]
    by_split = {s: float(np.mean([scores[s] for scores in per_start])) for s in splits}
    n = len(evals)
    name = f"SFT start ({execution})" if n == 1 else f"SFT starts ({execution}, mean of {n})"
    row = {"run": name, **by_split}
    row["average"] = benchmark_average(by_split, splits)
    return row


def run_execution(table: Table, label: str) -> str:
    """How run `label`'s rollouts and held-out evaluations execute: "bf16" for a method whose
    rollout quantizes nothing, else its FP4 format (e.g. "nvfp4")."""
    rl = table.run_config(label, table.seeds[0]).rl
    return "bf16" if get_method(rl.method).rollout_mode == SiteMode.OFF else rl.format


def start_row(table: Table, workdir: str, label: str) -> dict | None:
    """Where run `label` starts: `sft_row` under the run's own execution (`run_execution`)."""
    return sft_row(table, workdir, run_execution(table, label))


def sft_rows(table: Table, workdir: str) -> list[dict]:
    """`sft_row` for every execution the SFT evaluations ran, bf16 first."""
    evals = _sft_evals(table, workdir)
    if not evals:
        return []
    executions = [k.removeprefix("pass@1_") for k in evals[0][0] if k.startswith("pass@1_")]
    executions.sort(key=lambda e: e != "bf16")
    return [row for e in executions if (row := sft_row(table, workdir, e)) is not None]


def adaptation(
    table: Table, workdir: str, run: str = "trace", reference: str = "bf16"
) -> dict | None:
    """When `run` first matches `reference` on the hardest benchmark split (the one the SFT
    policy scores lowest on; without an SFT evaluation, the one `reference` ends lowest on).

    "Matches" at an evaluation step: `run`'s mean over finished seeds is at least `reference`'s
    mean minus its sample std over seeds. Returns {"split", "run", "reference", "points": per
    evaluation step {"step", run: mean, reference: mean, "ref_std"}, "matched_at": the first
    matching step or None}; None if either run is not in the table or has no finished seed.
    """
    if run not in table.labels or reference not in table.labels:
        return None
    evals = {}
    for label in (run, reference):
        seeds = finished_seeds(table, workdir, label)
        if not seeds:
            return None
        evals[label] = [eval_rows(run_dir(workdir, label, s)) for s in seeds]
    bench = benchmark_splits(table.experiment.eval.splits)
    start = sft_row(table, workdir)
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


def shared_runs(table: Table, workdir: str) -> list[tuple[str, int, str]]:
    """(label, seed, source) of this table's runs whose logs are another table's run, trained
    once for both (`same_run_as.txt`, written by `trace_jax.tables.queue.copy_run`)."""
    out = []
    for label in table.labels:
        for seed in table.seeds:
            path = os.path.join(run_dir(workdir, label, seed), "same_run_as.txt")
            if os.path.exists(path):
                with open(path) as f:
                    out.append((label, seed, f.read().strip()))
    return out


# Per-step training-log curves of a table's runs (`curves`).
CURVE_KEYS = ("reward", "train_rollout_gap_mean", "train_rollout_kl_k3")


def curves(table: Table, workdir: str) -> list[dict]:
    """Per run with finished seeds, its curves averaged over them: {"run", "steps" (training
    steps), each of `CURVE_KEYS` that every seed logged at every step (per step), "eval_steps",
    "score" (benchmark average pass@1 per evaluation step) and, where every evaluation also
    scored the policy in bf16 (FP4 runs with `eval.in_bf16_too`), "score_bf16"}."""
    splits = table.experiment.eval.splits
    out = []
    for label in table.labels:
        dirs = [run_dir(workdir, label, s) for s in finished_seeds(table, workdir, label)]
        if not dirs:
            continue
        metrics = [_log(d, "rl_metrics") for d in dirs]
        evals = [eval_rows(d) for d in dirs]
        steps = [r["step"] for r in metrics[0]]
        eval_steps = [r["step"] for r in evals[0]]
        row = {"run": label, "steps": steps, "eval_steps": eval_steps}
        for key in CURVE_KEYS:
            if all(key in r for m in metrics for r in m[: len(steps)]):
                row[key] = np.mean([[r[key] for r in m[: len(steps)]] for m in metrics], 0).tolist()
        row["score"] = np.mean(
            [[benchmark_average(r, splits) for r in e[: len(eval_steps)]] for e in evals], 0
        ).tolist()
        if all(s + BF16_SUFFIX in r for e in evals for r in e for s in splits):
            in_bf16 = [
                [benchmark_average({s: r[s + BF16_SUFFIX] for s in splits}, splits) for r in e]
                for e in evals
            ]
            row["score_bf16"] = np.mean([x[: len(eval_steps)] for x in in_bf16], 0).tolist()
        out.append(row)
    return out
