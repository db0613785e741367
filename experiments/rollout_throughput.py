r"""Whole rollouts at the paper's model shapes: tokens/s, prefill, and the decode step against its
byte limit, for bf16, FP4 and FP4 with guidance capture.

The paper's speed claim (SPEC section 8): FP4 rollouts run faster than bf16, and caching compact
guidance keeps them near plain FP4 (full guidance costs more). This runs the real sampler
(`trace_jax.rollout.generate`: chunked prefill + the jitted decode loop) on a randomly initialized
model with bf16 parameters (initialized on the device), with no stop token so that every sequence
decodes all its new tokens. `config.model_init` says how the model is initialized
(`trace_jax.rollout.variants.MODEL_INITS`): by default with selective attention, whose routers
spread a prompt's tokens over all experts as a load-balanced trained router does; "normal" is the
plain init, whose routers send nearly every token of a prompt to the same top-k experts (the
results before the option; docs/kernels.md, "The benchmark model's routing"). Variants
(`trace_jax.rollout.variants.ROLLOUT_VARIANTS`):

  * bf16           : no quantization; routed experts by the config's `model.grouped_matmul`;
  * fp4            : NVFP4 W/A/KV on the Pallas kernels (packed experts, packed KV cache);
  * fp4 + compact  : the same, recording TRACE's compact guidance at the method's guided sites;
  * fp4 + full     : the same, recording full codes at every FP4 site (TRACE-full);
  * fp4 xla        : NVFP4 W/A/KV by XLA fake quantization (the reference path; not a default);
  * bf16 + flash prefill, fp4 + flash prefill : bf16, fp4 with the prefill chunks' attention by
    the flash kernel (`kernels_pallas.prefill_attention`; not defaults), and `+ cudnn prefill`
    by cuDNN's fused attention;
  * fp4 + in-kernel decode, fp4 + cudnn prefill + in-kernel decode : fp4, fp4 + cudnn prefill
    with the prefill chunks' FP4 expert weights decoded in the kernel (`ModelConfig.
    predecode_experts=False`), where the op's default decodes them before each call.

Each row of `config.rows` is (batch, prompt tokens, new tokens N). Per variant one rollout of N
new tokens is compiled ahead of time; `generate`'s traced `new_token_limit` runs it whole (N) or as
the prompt's prefill and the first sample (1: the decode loop runs no step). After one warm-up
rollout per variant, both lengths of every variant are timed in `repeats` alternating rounds
(`timing.time_interleaved`), so that a drift of the device falls on every variant alike. From the
medians: tokens/s = batch * N / rollout time; `prefill_ms` = the one-token rollout;
`decode_ms_per_step` = (rollout - one-token rollout) / (N - 1) (the slope between the two lengths,
median of the rounds' slopes). Each entry keeps its compile seconds and `temp_gib`, XLA's
temporary buffers of the compiled rollout (beside the parameters, inputs and outputs).

A decode step's byte limit is the bytes it must read over the read bandwidth measured in the same
command (`harness.ceilings`): every dense weight (attention, router, norms, LM head; the embedding
rows of the batch), the routed experts the step touches and the KV cache at the mean context of the
steps the slope covers (prompt + N / 2), weights and cache in the variant's storage format (packed
NVFP4 experts where the sampler packs them, the packed cache for every FP4 variant). With B tokens
each routed to K of E experts, near-uniformly at random weights, an expert is missed by one token
with probability 1 - K/E, so a layer reads E * (1 - (1 - K/E)^B) distinct experts on average.

Each row's rough time is printed before it (`RolloutBench.estimate_s`). `config.compile_only`
compiles every variant of every row from parameter shapes only, runs nothing and prints compile
seconds, memory and the rows' estimates with these compile times: a first check on a device.

A variant that fails (for instance RESOURCE_EXHAUSTED at compile or run) is recorded with the first
line of its error and the rest go on. Results go to `<outdir>/<name>.{json,md,png}` after every row
(a command stopped by its time limit keeps the rows it finished); `config.merge` merges them into an
existing JSON by (row, variant), so that several commands build one result. `--plot_from=<json>`
only redraws the PNG. Sizes and launch commands: configs/rollout_throughput.py.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
from collections.abc import Sequence

import jax.numpy as jnp
import matplotlib
from absl import app, flags, logging
from ml_collections import ConfigDict

from experiments import harness, timing
from trace_jax.models import ModelConfig, active_param_count
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ModelSpec
from trace_jax.rollout.variants import (
    MODEL_INITS,
    ROLLOUT_VARIANTS,
    compile_rollout,
    decode_step_bytes,
    rollout_inputs,
    rollout_policy,
    routing_balance,
    run_full_length,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REQUIRED_ROW_KEYS = ("batch", "prompt_len", "new_tokens", "variants")
TABLE_COLUMNS = ["batch", "prompt_len", "new_tokens", "variant", "tokens_per_s", "speedup_vs_bf16"]
TABLE_COLUMNS += ["prefill_ms", "decode_ms_per_step", "byte_limit_ms", "byte_limit_ratio"]
TABLE_COLUMNS += ["prefill_busiest_over_mean", "decode_active_experts", "compile_s", "temp_gib"]
TABLE_COLUMNS += ["error"]
COMPILE_COLUMNS = [*TABLE_COLUMNS[:4], "compile_s", "temp_gib", "error"]


def first_line(error: Exception) -> str:
    """`Type: first non-empty line of the message` (at most 300 characters)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


class RolloutBench:
    """The model of `config` (bf16 parameters on the device, or their shapes only with
    `config.compile_only`) and the read bandwidth; `measure(row, run)` times (or only compiles)
    every variant of one row."""

    def __init__(self, config: ConfigDict, read_bw: float):
        spec = from_section(ModelSpec, config.model)
        self.config, self.read_bw = config, read_bw
        self.cfg, self.graphdef, self.params = rollout_policy(
            spec.build(), abstract=config.compile_only, init=config.model_init
        )

    def estimate_s(self, row: tuple[int, int, int], compile_s: dict | None = None) -> dict:
        """Rough seconds `measure(row)` takes, by `config.estimate`: "compile_s" (measured per
        variant in `compile_s` where given), "run_s" (each variant's 1 + repeats whole rollouts
        and `repeats` prefills; prefill FLOPs at the assumed rate, decode steps at their byte
        limit times `over_limit`) and "total_s"."""
        (batch, prompt_len, new_tokens), cfg, est = row, self.cfg, self.config.estimate
        repeats, fmt = self.config.repeats, self.config.format
        # the blocks' weights (prefill gathers embeddings and takes the logits of the last token
        # only), and causal attention
        blocks = active_param_count(cfg) - cfg.vocab_size * cfg.d_model * (2 - cfg.tie_embeddings)
        flops = 2 * blocks * batch * prompt_len
        flops += 2 * batch * prompt_len**2 * cfg.n_heads * cfg.head_dim * cfg.n_layers
        prefill_s, context = flops / est.prefill_flop_per_s, prompt_len + new_tokens // 2
        out = {"compile_s": 0.0, "run_s": 0.0}
        for v in self.config.variants:
            step = decode_step_bytes(self.graphdef, self.params, v, fmt, batch, context)
            rollout_s = prefill_s + (new_tokens - 1) * step["total"] / self.read_bw * est.over_limit
            per_block = est.fp4_compile_s if ROLLOUT_VARIANTS[v].fp4 else est.bf16_compile_s
            out["compile_s"] += (compile_s or {}).get(v, per_block * cfg.n_layers)
            out["run_s"] += (1 + repeats) * rollout_s + repeats * prefill_s
        return {**out, "total_s": out["compile_s"] + out["run_s"]}

    def prepare(self, variant: str, row: tuple[int, int, int], inputs) -> dict:
        """Compiles `variant`'s rollout of `row` (`compile_rollout`: one compile for every
        `new_token_limit`) and runs one whole rollout as its warm-up (not with
        `config.compile_only`) -> {"call", "compile_s", "temp_gib", and after the warm-up
        "routing": `routing_balance` per layer and its summaries "prefill_busiest_over_mean"
        (median over layers) and "decode_active_experts" (mean over layers)}; raises what
        compiling or running raises."""
        new_tokens = row[2]
        fmt, chunk = self.config.format, self.config.prefill_chunk_tokens
        ready = compile_rollout(
            self.cfg,
            self.graphdef,
            inputs,
            variant,
            new_tokens,
            fmt=fmt,
            prefill_chunk_tokens=chunk,
        )
        if not self.config.compile_only:
            roll = run_full_length(ready, inputs, variant, new_tokens)
            routing = routing_balance(roll, self.cfg.n_experts)
            ready.update(
                routing=routing,
                prefill_busiest_over_mean=statistics.median(routing["prefill_busiest_over_mean"]),
                decode_active_experts=statistics.fmean(routing["decode_active_experts"]),
            )
        return ready

    def measure(self, row: tuple[int, int, int], run: int) -> dict:
        """One row record: each variant's entry (numbers, or its error) under "variants". With
        `config.compile_only` the entries hold compile seconds and memory only, and the record
        the row's `estimate_s` with these compile times."""
        (batch, prompt_len, new_tokens), fmt = row, self.config.format
        inputs = rollout_inputs(self.cfg, self.params, batch, prompt_len)
        record = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens}
        entries, calls = {}, {}
        for variant in self.config.variants:
            try:
                ready = self.prepare(variant, row, inputs)
            except Exception as e:  # recorded; the other variants still run
                logging.exception("%s at %s failed", variant, row)
                entries[variant] = {"error": first_line(e), "run": run}
                continue
            compiled = ready.pop("call")
            for n in (new_tokens, 1):  # the whole rollout, and prefill + the first sample
                calls[f"{variant}/{n}"] = (compiled, (*inputs, jnp.int32(n)))
            entries[variant] = {**ready, "run": run}
            logging.info("row %s: %s compiled (%.0f s)", row, variant, ready["compile_s"])
        if self.config.compile_only:
            compile_s = {v: e["compile_s"] for v, e in entries.items() if "compile_s" in e}
            return {**record, "variants": entries, "estimate_s": self.estimate_s(row, compile_s)}
        timed = [v for v in entries if "error" not in entries[v]]
        rounds: dict[str, list[float]] = {}
        try:
            if calls:  # warmed up above; whole rollouts need one call per round
                trials = dict(rounds=self.config.repeats, inner=1, trials=1, warmup=0)
                rounds = timing.time_interleaved(calls, **trials)
        except Exception as e:
            logging.exception("timing row %s failed", row)
            entries.update({v: {"error": first_line(e), "run": run} for v in timed})
            timed = []
        context = prompt_len + new_tokens // 2  # mean context of decode steps 1 .. N - 1
        for variant in timed:
            full, one = rounds[f"{variant}/{new_tokens}"], rounds[f"{variant}/1"]
            slopes = [(a - b) / (new_tokens - 1) for a, b in zip(full, one, strict=True)]
            nbytes = decode_step_bytes(self.graphdef, self.params, variant, fmt, batch, context)
            decode_ms = 1e3 * statistics.median(slopes)
            limit_ms = 1e3 * nbytes["total"] / self.read_bw
            entries[variant].update(
                rollout_s=statistics.median(full),
                tokens_per_s=batch * new_tokens / statistics.median(full),
                prefill_ms=1e3 * statistics.median(one),
                decode_ms_per_step=decode_ms,
                decode_bytes_per_step=nbytes,
                byte_limit_ms=limit_ms,
                byte_limit_ratio=decode_ms / limit_ms,
                read_bw_GBps=self.read_bw / 1e9,
                rollout_s_by_round=full,
                prefill_s_by_round=one,
            )
        return {**record, "variants": entries}


def time_ratio(a: dict, b: dict) -> float:
    """Entry a's rollout time over entry b's: the median of same-round ratios when one command
    timed both (alternately), else the ratio of their medians."""
    if a["run"] == b["run"]:
        by_round = {"a": a["rollout_s_by_round"], "b": b["rollout_s_by_round"]}
        return timing.paired_ratio(by_round, "a", "b")
    return a["rollout_s"] / b["rollout_s"]


def summarize_row(record: dict) -> dict:
    """`record` with its comparisons (re)computed from its variants' entries (None where a
    variant is missing or failed): `fp4_speedup_vs_bf16` (fp4 tokens/s over bf16's), the bf16
    and fp4 decode steps' `*_byte_limit_ratio`, `compact_capture_overhead` and
    `full_capture_overhead` (rollout time over fp4's - 1), and each entry's `speedup_vs_bf16`.
    Returns a new record (its entries copied)."""
    variants = {k: dict(e) for k, e in record["variants"].items()}
    timed = {k: e for k, e in variants.items() if "rollout_s" in e}
    bf16, fp4 = timed.get("bf16"), timed.get("fp4")
    for entry in timed.values():
        entry["speedup_vs_bf16"] = None if bf16 is None else time_ratio(bf16, entry)
    out = {
        **record,
        "variants": variants,
        "fp4_speedup_vs_bf16": None if bf16 is None or fp4 is None else time_ratio(bf16, fp4),
        "bf16_byte_limit_ratio": None if bf16 is None else bf16["byte_limit_ratio"],
        "fp4_byte_limit_ratio": None if fp4 is None else fp4["byte_limit_ratio"],
    }
    for label in ("compact", "full"):
        entry = timed.get(f"fp4 + {label}")
        overhead = None if entry is None or fp4 is None else time_ratio(entry, fp4) - 1
        out[f"{label}_capture_overhead"] = overhead
    return out


def row_key(record: dict) -> tuple[int, int, int]:
    return record["batch"], record["prompt_len"], record["new_tokens"]


def merge_rows(old: Sequence[dict], new: Sequence[dict]) -> list[dict]:
    """Rows of `old` and `new` by (batch, prompt_len, new_tokens), a variant's entry of `new`
    replacing `old`'s; old rows first, each summarized again."""
    merged: dict[tuple, dict] = {}
    for record in [*old, *new]:
        key = row_key(record)
        if key in merged:
            variants = {**merged[key]["variants"], **record["variants"]}
            merged[key] = {**merged[key], "variants": variants}
        else:
            merged[key] = {**record, "variants": dict(record["variants"])}
    return [summarize_row(r) for r in merged.values()]


def summarize(records: Sequence[dict], min_batch: int) -> dict:
    """The worst case over rows of at least `min_batch` sequences (None where no row has it):
    the largest byte-limit ratios and compact capture overhead, the smallest FP4 speedup."""

    def worst(key, pick):
        values = [r[key] for r in records if r["batch"] >= min_batch and r[key] is not None]
        return pick(values) if values else None

    return {
        "bf16_byte_limit_ratio": worst("bf16_byte_limit_ratio", max),
        "fp4_byte_limit_ratio": worst("fp4_byte_limit_ratio", max),
        "compact_capture_overhead": worst("compact_capture_overhead", max),
        "fp4_speedup_vs_bf16_worst": worst("fp4_speedup_vs_bf16", min),
        "summary_min_batch": min_batch,
    }


def table_rows(records: Sequence[dict]) -> list[dict]:
    """One flat row per (row, variant) for the markdown table."""
    out = []
    for r in records:
        for variant, entry in r["variants"].items():
            flat = {k: r[k] for k in ("batch", "prompt_len", "new_tokens")}
            flat.update(variant=variant, **entry)
            if "error" in flat:  # a table cell: no column separators
                flat["error"] = flat["error"].replace("|", "/")
            out.append(flat)
    return out


def tokens_per_s_points(records, variant, keep, x) -> tuple[list, list]:
    """(x, tokens/s) of `variant`'s timed entries in the rows `keep` selects, sorted by x."""
    points = sorted(
        (x(r), r["variants"][variant]["tokens_per_s"])
        for r in records
        if keep(r) and "tokens_per_s" in r["variants"].get(variant, {})
    )
    return [p[0] for p in points], [p[1] for p in points]


def plot(records: Sequence[dict], path: str) -> None:
    """tokens/s against batch at the most common (prompt, new tokens) of the rows (left), and
    against the context (prompt + new tokens) at the most common batch (right); one line per
    variant."""
    lengths = collections.Counter((r["prompt_len"], r["new_tokens"]) for r in records)
    lengths, _ = lengths.most_common(1)[0]
    prompt_len, new_tokens = lengths
    batch, _ = collections.Counter(r["batch"] for r in records).most_common(1)[0]
    variants = list(dict.fromkeys(v for r in records for v in r["variants"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    panels = [  # (axes, rows on its lines, x)
        (left, lambda r: (r["prompt_len"], r["new_tokens"]) == lengths, lambda r: r["batch"]),
        (right, lambda r: r["batch"] == batch, lambda r: r["prompt_len"] + r["new_tokens"]),
    ]
    for i, variant in enumerate(variants):
        for ax, keep, x in panels:
            xs, ys = tokens_per_s_points(records, variant, keep, x)
            if xs:
                ax.plot(xs, ys, marker="o", color=f"C{i}", label=variant)
    left.set(xlabel="batch", title=f"prompt {prompt_len}, {new_tokens} new tokens")
    right.set(xlabel="context (prompt + new tokens)", title=f"batch {batch}")
    for ax in (left, right):
        ax.set(ylabel="tokens / s")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(8)
    left.legend(fontsize=7)
    fig.suptitle("Rollout throughput", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_from(path: str) -> str:
    """Redraws `<name>.png` beside a written `<name>.json`; returns the PNG's path."""
    records = harness.rows_written_by(path, "experiments.rollout_throughput", REQUIRED_ROW_KEYS)
    out = os.path.splitext(path)[0] + ".png"
    plot(records, out)
    return out


def check_config(config: ConfigDict) -> list[tuple[int, int, int]]:
    """The rows of `config`, checked with its variants and model init; ValueError naming a bad
    one."""
    if config.model_init not in MODEL_INITS:
        raise ValueError(
            f"unknown model_init {config.model_init!r}; choose from {list(MODEL_INITS)}"
        )
    unknown = sorted(set(config.variants) - set(ROLLOUT_VARIANTS))
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(ROLLOUT_VARIANTS)}")
    rows = [tuple(r) for r in config.rows]
    if not rows:
        raise ValueError("rows is empty; give (batch, prompt tokens, new tokens) rows")
    for r in rows:  # the decode step is the slope between N and 1 new tokens: N >= 2
        if len(r) != 3 or not all(isinstance(n, int) and n >= 1 for n in r) or r[2] < 2:
            raise ValueError(f"row {r} is not (batch >= 1, prompt >= 1, new tokens >= 2) ints")
    if len(set(rows)) != len(rows):
        raise ValueError(f"rows {rows} repeat a row")
    if config.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {config.repeats}")
    return rows


def previous_result(path: str) -> tuple[list[dict], list[dict]]:
    """The rows and runs of a result this module wrote at `path`; none if there is no file."""
    if not os.path.exists(path):
        return [], []
    records = harness.rows_written_by(path, "experiments.rollout_throughput", REQUIRED_ROW_KEYS)
    with open(path) as f:
        return records, json.load(f).get("runs", [])


def notes(config: ConfigDict, cfg: ModelConfig) -> str:
    return (
        f"Model `{config.model.preset}` (n_layers={cfg.n_layers}), bf16 parameters (random "
        f"init `model_init={config.model_init}`: {MODEL_INITS[config.model_init]}), "
        f"`grouped_matmul={cfg.grouped_matmul}` for bf16's experts; {config.format} "
        "W/A/KV for the FP4 variants; temperature 1, no stop token. Per row every variant is "
        f"timed in {config.repeats} alternating round(s) after a warm-up. `prefill_ms`: a rollout "
        "of one new token (prefill and the first sample, no decode step); `decode_ms_per_step`: "
        "the slope between N and one new tokens; `byte_limit_ms`: the weights and KV cache one "
        "decode step reads (mean context, expected distinct experts) over the read bandwidth "
        "measured in the same command. Speedups and capture overheads are medians of same-round "
        "ratios. `+ compact`: TRACE's compact guidance at its guided sites; `+ full`: full codes "
        "at every FP4 site. `prefill_busiest_over_mean`: in one prompt's prefill, the busiest "
        "expert's rows over the mean (median over layers; uniform routing about 1.1, every token "
        "on the same top-k experts n_experts / top_k); `decode_active_experts`: experts with rows "
        "in one decode step (mean over layers; `routing` per layer in the JSON). Each entry's "
        "command is `runs[entry.run]` in the JSON." + (harness.SMOKE_NOTE if config.smoke else "")
    )


def estimate_line(row: tuple[int, int, int], est: dict, note: str = "") -> str:
    return f"row {row}: about {est['total_s']:.0f} s ({est['compile_s']:.0f} s compiling{note})"


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Times every row and writes `<outdir>/<name>.{json,md,png}` after each (merged into the
    existing JSON with `config.merge`); returns the row records. `config.compile_only`: only
    compiles them, and prints compile seconds, memory and time estimates."""
    rows = check_config(config)
    init = config.model_init
    json_path = os.path.join(outdir, f"{name}.json")
    old, runs = previous_result(json_path) if config.merge else ([], [])
    ceil = harness.ceilings(config.ceiling_bytes, smoke=config.smoke)
    logging.info("ceilings %s", ceil)
    bench = RolloutBench(config, ceil["read_bw"])
    if config.compile_only:  # no rollout runs, no file is written
        records = []
        for row in rows:
            records.append(bench.measure(row, run=0))
            print(estimate_line(row, records[-1]["estimate_s"], " with these compiles"), flush=True)
        print(harness.markdown_table(table_rows(records), COMPILE_COLUMNS))
        return records
    meta = harness.provenance()
    runs = [*runs, {**{k: meta[k] for k in ("date", "device", "command")}, "model_init": init}]
    new, table = [], ""
    for i, row in enumerate(rows):
        print(f"row {i + 1}/{len(rows)} (batch, prompt, new tokens) = {row}", flush=True)
        print(estimate_line(row, bench.estimate_s(row)), flush=True)
        new.append(bench.measure(row, run=len(runs) - 1))
        records = merge_rows(old, new)
        extra = {
            "device": meta["device"],
            "model_init": init,  # of this command; each run's in `runs`
            "read_bw_GBps": ceil["read_bw"] / 1e9,
            **summarize(records, config.summary_min_batch),
            "runs": runs,
        }
        table = harness.markdown_table(table_rows(records), TABLE_COLUMNS)
        harness.write_results(
            name,
            records,
            title="Rollout throughput at the model's shapes",
            table=table,
            notes=notes(config, bench.cfg)
            + f"\n\n![tokens/s against batch and context]({name}.png)",
            outdir=outdir,
            extra=extra,
        )
        plot(records, os.path.join(outdir, f"{name}.png"))
        for variant, entry in new[-1]["variants"].items():
            done = entry.get("error") or f"{entry['tokens_per_s']:.0f} tokens/s"
            print(f"  {variant:14s} {done}", flush=True)
    print(table)
    return records


def main(argv):
    del argv
    f = flags.FLAGS
    if f.plot_from:
        print(f"wrote {plot_from(f.plot_from)}")
        return
    with harness.smoke_interpretation(f.config):
        run(f.config, outdir=f.outdir, name=f.name)


def define_flags() -> None:
    harness.define_config_flag("rollout_throughput")
    harness.define_result_flags("rollout_throughput")
    flags.DEFINE_string("plot_from", "", "only redraw the PNG of this written JSON")


if __name__ == "__main__":
    define_flags()
    app.run(main)
