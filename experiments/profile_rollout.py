r"""Where a rollout's time goes on the device: its kernels, per decode step and in prefill.

The rollout of `experiments/rollout_throughput.py` (`trace_jax.rollout.variants`: the same model,
variants and compiled `generate`) runs twice per variant under `jax.profiler.trace`: whole (N new
tokens) and as prefill + the first sample (1). Every kernel the device ran is read back from the
profile's trace (the events of the device's "Stream" threads: one event per kernel launch or copy,
so nothing is counted twice); per kernel name, the prefill's share is the one-token rollout's time,
and a decode step's share is (whole - one-token) / (N - 1), the same slope `rollout_throughput`
times. Kernels are grouped (`kernel_group`): the Pallas FP4 kernels, the bf16 Pallas grouped matmul,
the Pallas prefill attention, library attention (cuDNN) and matmuls (cuBLAS / cuDNN / CUTLASS),
XLA fusions, copies and the rest. Device-busy time is the sum of kernel times (streams overlap
little in these programs); the gap to the step's wall time is launch latency and idle. On the
CPU backend (the smoke run) the host's XLA thunks stand in for kernels.

Results: `<outdir>/<name>.{json,md}`, per variant and phase the groups and the top kernels.
Command lines: configs/profile_rollout.py.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from ml_collections import ConfigDict

from experiments import harness, timing
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ModelSpec
from trace_jax.rollout.variants import (
    MODEL_INITS,
    ROLLOUT_VARIANTS,
    compile_rollout,
    rollout_inputs,
    rollout_policy,
    run_full_length,
)

# (group, pattern on the lower-cased kernel name); the first match wins
KERNEL_GROUPS = (
    ("pallas fp4", r"fp4"),
    # cuDNN's fused attention ("..._sdpa_..._flash_fprop_wgmma_..."), before the grouped matmul:
    # Hopper's "wgmma" instruction names hold "gmm"
    ("library attention", r"sdpa|fmha|flash_fprop"),
    ("pallas bf16 grouped matmul", r"(?<![a-z])gmm|grouped|moe_matmul"),
    ("pallas prefill attention", r"prefill_attention"),
    ("library matmul", r"gemm|nvjet|cutlass|sm90|cublas|cudnn|xmma"),
    ("copy / memset", r"memcpy|memset|copy"),
    ("xla fusion", r"fusion|reduce|transpose|scatter|gather|concatenate|dynamic|select"),
)
OTHER = "other"
# host thunks that run others (their time is their children's): not counted on the CPU backend
HOST_CONTROL_FLOW = re.compile(r"(while|cond|conditional|call)(\.\d+)?$")


def kernel_group(name: str) -> str:
    """The group of a kernel's name (`KERNEL_GROUPS`), "other" where none matches."""
    low = name.lower()
    return next((g for g, pattern in KERNEL_GROUPS if re.search(pattern, low)), OTHER)


def device_kernel_times(events: Iterable[dict]) -> dict[str, dict[str, float]]:
    """Kernel name -> {"count", "us"} from a trace-event list (the profiler's
    `*.trace.json.gz`): the complete ("X") events on the "Stream" threads of every device process
    (name starting "/device:"; a GPU's kernels and copies). Threads of derived views ("XLA Ops",
    "XLA Modules", "Steps") repeat those times and are skipped. Without device streams (the CPU
    backend), the host's XLA thunk executions: events whose `args.hlo_op` is their name, control
    flow (`HOST_CONTROL_FLOW`) left out. Raises ValueError where device processes have no
    "Stream" thread."""
    events = list(events)
    devices = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith("/device:")
    }
    streams = {
        (e["pid"], e["tid"])
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and e.get("pid") in devices
        and str(e.get("args", {}).get("name", "")).startswith("Stream")
    }
    if streams:
        kernels = [
            e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams
        ]
    elif devices:  # a device process without streams: a trace format this parser does not know
        names = sorted(
            {
                str(e.get("args", {}).get("name"))
                for e in events
                if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in devices
            }
        )
        raise ValueError(f"device processes without 'Stream' threads; their threads: {names}")
    else:
        kernels = [
            e
            for e in events
            if e.get("ph") == "X"
            and (e.get("args") or {}).get("hlo_op") == e.get("name")
            and not HOST_CONTROL_FLOW.match(e["name"])
        ]
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"count": 0, "us": 0.0})
    for e in kernels:
        entry = out[e["name"]]
        entry["count"] += 1
        entry["us"] += float(e.get("dur", 0.0))
    return dict(out)


def trace_path(log_dir: str) -> str:
    """The newest `*.trace.json.gz` the profiler wrote under `log_dir`."""
    paths = sorted(glob.glob(os.path.join(log_dir, "plugins/profile/*/*.trace.json.gz")))
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}/plugins/profile")
    return paths[-1]


def read_trace(path: str) -> list[dict]:
    """The trace events of a profiler's `*.trace.json.gz`."""
    with gzip.open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def profile_call(compiled, args, log_dir: str, keep_as: str | None = None) -> dict:
    """Runs `compiled(*args)` once under the profiler -> its device kernel times
    (`device_kernel_times`); the trace is copied to `keep_as` where given."""
    with jax.profiler.trace(log_dir):
        jax.block_until_ready(compiled(*args))
    path = trace_path(log_dir)
    if keep_as:
        os.makedirs(os.path.dirname(keep_as), exist_ok=True)
        shutil.copyfile(path, keep_as)
    return device_kernel_times(read_trace(path))


def phase_summary(kernels: dict[str, dict[str, float]], scale: float, top: int) -> dict:
    """`kernels` (name -> {"count", "us"}) times `scale` (1 for prefill, 1 / (N - 1) per decode
    step): "busy_ms" and "launches" in all, "groups" (group -> {"ms", "launches", "share"}) and
    the `top` kernels by time (name, group, ms, launches, share). Entries below zero (a kernel
    that ran less in the whole rollout than in the one-token one) count as zero."""
    rows = [
        {
            "kernel": name,
            "group": kernel_group(name),
            "ms": max(k["us"], 0.0) * scale / 1e3,
            "launches": max(k["count"], 0) * scale,
        }
        for name, k in kernels.items()
    ]
    busy = sum(r["ms"] for r in rows)
    groups: dict[str, dict[str, float]] = {}
    for r in rows:
        g = groups.setdefault(r["group"], {"ms": 0.0, "launches": 0.0})
        g["ms"] += r["ms"]
        g["launches"] += r["launches"]
    for r in [*rows, *groups.values()]:
        r["share"] = r["ms"] / busy if busy else 0.0
    rows.sort(key=lambda r: -r["ms"])
    return {
        "busy_ms": busy,
        "launches": sum(r["launches"] for r in rows),
        "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["ms"])),
        "top": rows[:top],
    }


def difference(a: dict, b: dict) -> dict[str, dict[str, float]]:
    """Per kernel name, `a` minus `b` (counts and microseconds)."""
    names = set(a) | set(b)
    zero = {"count": 0, "us": 0.0}
    return {n: {k: a.get(n, zero)[k] - b.get(n, zero)[k] for k in ("count", "us")} for n in names}


def profile_variant(
    config: ConfigDict, policy: tuple, variant: str, row, log_dir: str, keep_dir: str | None = None
) -> dict:
    """Compiles `variant`'s rollout of `row` on `policy` (`rollout_policy`'s (cfg, graphdef,
    params)) and warms it up, times it whole and as prefill + one sample (`config.repeats`
    alternating rounds, medians), then profiles each once -> {"prefill": ..., "decode_step": ...}:
    `phase_summary` (`config.top` kernels) plus the phase's wall time ("wall_ms") and the busy
    share of it ("busy_fraction"; None where the wall time is not positive, as a noisy slope over
    few steps can be). The two traces are copied to
    `keep_dir/<variant>_{whole,prefill}.trace.json.gz` where given."""
    (batch, prompt_len, new_tokens), (cfg, graphdef, params) = row, policy
    if new_tokens < 2:
        raise ValueError(f"a decode step needs at least 2 new tokens, got {new_tokens}")
    inputs = rollout_inputs(cfg, params, batch, prompt_len)
    chunk = config.prefill_chunk_tokens
    ready = compile_rollout(
        cfg, graphdef, inputs, variant, new_tokens, fmt=config.format, prefill_chunk_tokens=chunk
    )
    run_full_length(ready, inputs, variant, new_tokens)
    compiled, top = ready["call"], config.top
    calls = {n: (compiled, (*inputs, jnp.int32(n))) for n in (new_tokens, 1)}
    rounds = timing.time_interleaved(calls, rounds=config.repeats, inner=1, trials=1, warmup=0)
    slopes = [
        (a - b) / (new_tokens - 1) for a, b in zip(rounds[new_tokens], rounds[1], strict=True)
    ]
    wall_ms = {"decode_step": 1e3 * statistics.median(slopes)}
    wall_ms["prefill"] = 1e3 * statistics.median(rounds[1])
    kernels = {}
    for phase, n in (("whole", new_tokens), ("prefill", 1)):
        keep = keep_dir and os.path.join(keep_dir, f"{variant}_{phase}.trace.json.gz")
        kernels[phase] = profile_call(compiled, calls[n][1], f"{log_dir}/{phase}", keep)
    if not kernels["whole"]:
        raise RuntimeError(
            f"{variant}: the profile holds no kernels (no device 'Stream' threads, no XLA "
            "thunks on the host): a profiler without device tracing?"
        )
    per_step = 1.0 / (new_tokens - 1)
    out = {
        "prefill": phase_summary(kernels["prefill"], 1.0, top),
        "decode_step": phase_summary(
            difference(kernels["whole"], kernels["prefill"]), per_step, top
        ),
    }
    for phase, s in out.items():
        s["wall_ms"] = wall_ms[phase]
        s["busy_fraction"] = s["busy_ms"] / wall_ms[phase] if wall_ms[phase] > 0 else None
    return out


def markdown(records: dict) -> str:
    """Per variant and phase: the groups' table, then the top kernels'."""
    parts = []
    for variant, phases in records.items():
        for phase, s in phases.items():
            head = f"### {variant}, {phase.replace('_', ' ')}: {s['wall_ms']:.3f} ms wall, "
            share = "n/a" if s["busy_fraction"] is None else f"{s['busy_fraction']:.0%}"
            head += f"{s['busy_ms']:.3f} ms of kernels ({share}), "
            parts.append(head + f"{s['launches']:.0f} kernels")
            groups = [{"group": g, **v} for g, v in s["groups"].items()]
            parts.append(harness.markdown_table(groups, ["group", "ms", "launches", "share"]))
            parts.append(
                harness.markdown_table(s["top"], ["kernel", "group", "ms", "launches", "share"])
            )
    return "\n\n".join(parts)


def run(config: ConfigDict, *, outdir: str, name: str) -> dict:
    """Profiles every variant of `config.row` and writes `<outdir>/<name>.{json,md}`."""
    row = tuple(int(x) for x in config.row)
    unknown = sorted(set(config.variants) - set(ROLLOUT_VARIANTS))
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(ROLLOUT_VARIANTS)}")
    if len(row) != 3 or row[2] < 2:
        raise ValueError(f"row must be (batch, prompt tokens, new tokens >= 2), got {row}")
    policy = rollout_policy(from_section(ModelSpec, config.model).build(), init=config.model_init)
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in config.variants:
            logging.info("profiling %s at %s", variant, row)
            keep = os.path.join(outdir, f"{name}_traces") if config.keep_traces else None
            records[variant] = profile_variant(
                config, policy, variant, row, f"{tmp}/{variant}", keep
            )
            for phase, s in records[variant].items():
                print(
                    f"{variant:14s} {phase:12s} {s['wall_ms']:9.3f} ms wall, "
                    f"{s['busy_ms']:9.3f} ms busy, {s['launches']:7.0f} kernels",
                    flush=True,
                )
    table = markdown(records)
    notes = (
        f"Model: `{config.model.preset}` cut to {policy[0].n_layers} blocks, bf16 parameters, "
        f"random weights (`model_init={config.model_init}`: "
        f"{MODEL_INITS[config.model_init]}); row (batch, prompt, new tokens) = {row}; "
        f"FP4 format {config.format}. "
        "Wall: medians of alternating timed rounds; kernels: the sum of device kernel times in one "
        "profiled call. A decode step: (whole rollout - one-token rollout) / (N - 1)."
    ) + (harness.SMOKE_NOTE if config.smoke else "")
    harness.write_results(
        name,
        [{"variant": v, **phases} for v, phases in records.items()],
        title="Where a rollout's device time goes",
        table=table,
        notes=notes,
        outdir=outdir,
        extra={"row": list(row), "model_init": config.model_init},
    )
    print(table)
    return records


def main(argv):
    del argv
    f = flags.FLAGS
    with harness.smoke_interpretation(f.config):
        run(f.config, outdir=f.outdir, name=f.name)


if __name__ == "__main__":
    harness.define_config_flag("profile_rollout")
    harness.define_result_flags("profile_rollout")
    app.run(main)
