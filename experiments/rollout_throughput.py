r"""Rollout decode throughput (tokens/s) against output length: bf16, FP4, FP4 + guidance capture.

The paper's speed claim (SPEC section 8): FP4 rollouts decode faster than BF16, more so at long
outputs, and caching compact guidance keeps throughput near plain FP4 (full guidance costs more).
This runs the real sampler (`trace_jax.rollout.generate`, prefill + the jitted decode loop) on a
randomly initialized model, with no stop token so every sequence decodes `length` tokens, and
times whole rollouts, side by side in one process:

  * bf16           : no quantization, XLA (the BF16 rollout);
  * fp4 xla        : NVFP4 W/A/KV with XLA fake quantization (reference path);
  * fp4 pallas     : NVFP4 W/A/KV on the Pallas kernels (packed experts, packed KV cache);
  * fp4 + compact  : the same, recording TRACE's compact guidance at the method's guided sites;
  * fp4 + full     : the same, recording full codes at every FP4 site (TRACE-full).

Each variant is compiled ahead of time (`jit(...).lower(...).compile()`); the reported time is the
median of `repeats` rollouts after one warm-up. Sizes and launch commands:
configs/decode_throughput.py. Writes `<outdir>/<name>.{md,json,png}` (default
`decode_throughput`); `--plot_from=<name>.json` only redraws the PNG of a written result.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import matplotlib
from absl import app, flags, logging
from flax import nnx
from ml_collections import ConfigDict

from experiments import harness
from trace_jax.fp4 import GuidanceMode
from trace_jax.models import ModelConfig, init_model
from trace_jax.quant import SiteMode
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ModelSpec
from trace_jax.rl.methods import get_method
from trace_jax.rollout import SamplingConfig, generate

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# label -> (FP4 rollout?, kernel implementation, capture: None | "method" (trace's sites) | "all")
VARIANTS = {
    "bf16": (False, "xla", None),
    "fp4 xla": (True, "xla", None),
    "fp4 pallas": (True, "pallas", None),
    "fp4 pallas + compact": (True, "pallas", "method"),
    "fp4 pallas + full": (True, "pallas", "all"),
}


def rollout_fn(cfg: ModelConfig, graphdef, variant: str, length: int, fmt: str = "nvfp4"):
    """`(params, prompts, prompt_lengths, key) -> Rollout` for one variant, not yet jitted."""
    fp4_on, implementation, capture = VARIANTS[variant]
    setup = get_method("trace").setup(fmt, cfg.n_layers)
    qcfg = setup.rollout_qcfg
    keys, cmode = (), GuidanceMode.COMPACT
    if capture == "method":
        keys, cmode = setup.capture, setup.capture_mode
    elif capture == "all":
        keys, cmode = qcfg.all_keys(cfg.n_layers), GuidanceMode.FULL
    sampling = SamplingConfig(max_new_tokens=length, temperature=1.0)  # no stop token
    return functools.partial(
        generate,
        graphdef,
        sampling=sampling,
        qcfg=qcfg,
        mode=SiteMode.RTN if fp4_on else SiteMode.OFF,
        capture=keys,
        capture_mode=cmode,
        implementation=implementation,
    )


def measure(
    cfg: ModelConfig,
    batch: int,
    prompt_len: int,
    lengths,
    variants,
    repeats: int,
    fmt: str = "nvfp4",
) -> list[dict]:
    """One row per (length, variant): seconds per rollout, tokens/s, speedup vs bf16."""
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    prompts = jax.random.randint(jax.random.key(1), (batch, prompt_len), 3, cfg.vocab_size)
    plens = jnp.full((batch,), prompt_len, jnp.int32)
    rows = []
    for length in lengths:
        base = None
        for variant in variants:
            fn = jax.jit(rollout_fn(cfg, graphdef, variant, length, fmt))
            t0 = time.perf_counter()
            compiled = fn.lower(params, prompts, plens, jax.random.key(2)).compile()
            compile_s = time.perf_counter() - t0
            times = []
            for r in range(repeats + 1):  # the first is the warm-up
                t0 = time.perf_counter()
                roll = jax.block_until_ready(compiled(params, prompts, plens, jax.random.key(r)))
                times.append(time.perf_counter() - t0)
            n_new = int((roll.lengths - roll.prompt_lengths).sum())
            if n_new != batch * length:  # the numbers below assume full-length rollouts
                raise RuntimeError(f"{variant}: {n_new} tokens decoded, want {batch * length}")
            sec = statistics.median(times[1:])
            row = {
                "output_length": length,
                "variant": variant,
                "batch": batch,
                "seconds": sec,
                "tokens_per_s": n_new / sec,
                "ms_per_decode_step": 1e3 * sec / length,
                "compile_s": compile_s,
            }
            base = sec if variant == "bf16" else base
            if base is not None:
                row["speedup_vs_bf16"] = base / sec
            rows.append(row)
            logging.info("%s", row)
            print(
                f"L={length:6d} {variant:22s} {row['tokens_per_s']:10.0f} tok/s "
                f"{row['ms_per_decode_step']:.3f} ms/step (compile {compile_s:.0f} s)",
                flush=True,
            )
    return rows


def latest_points(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """variant -> its rows by output length, the last row given for a (length, variant) winning
    (a merged file lists its runs oldest first)."""
    last = {(r["variant"], r["output_length"]): r for r in rows}
    by_variant: dict[str, list[dict]] = {}
    for (variant, _), row in sorted(last.items(), key=lambda kv: kv[0][1]):
        by_variant.setdefault(variant, []).append(row)
    return by_variant


def plot(rows: Sequence[dict], path: str) -> None:
    """tokens/s against output length, one line per variant (left), and each variant's ratio to
    the bf16 rollout of the same command (right); the latest measurement of each point."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (variant, points) in enumerate(latest_points(rows).items()):
        lengths = [r["output_length"] for r in points]
        style = {"marker": "o", "color": f"C{i}", "label": variant}
        left.plot(lengths, [r["tokens_per_s"] for r in points], **style)
        ratio = [r for r in points if "speedup_vs_bf16" in r]
        if ratio and variant != "bf16":
            x = [r["output_length"] for r in ratio]
            right.plot(x, [r["speedup_vs_bf16"] for r in ratio], **style)
    right.axhline(1.0, color="k", lw=0.8, ls=":")
    for ax, ylabel in ((left, "tokens / s"), (right, "throughput vs bf16 (same command)")):
        ax.set(xlabel="output length (new tokens)", ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle("Rollout decode throughput vs output length", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_from(path: str) -> str:
    """Redraws `<name>.png` beside a written `<name>.json`; returns the PNG's path."""
    required = ("variant", "output_length", "tokens_per_s")
    rows = harness.rows_written_by(path, "experiments.decode_throughput", required)
    out = os.path.splitext(path)[0] + ".png"
    plot(rows, out)
    return out


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Times every (length, variant) and writes `<outdir>/<name>.{md,json,png}`; returns the
    rows."""
    cfg = from_section(ModelSpec, config.model).build()
    unknown = set(config.variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    rows = measure(
        cfg,
        config.batch,
        config.prompt_len,
        config.lengths,
        config.variants,
        config.repeats,
        config.format,
    )
    cols = ["output_length", "variant", "tokens_per_s", "ms_per_decode_step", "speedup_vs_bf16"]
    notes = (
        f"Model `{config.model.preset}` (random init), batch {config.batch}, prompt "
        f"{config.prompt_len} tokens, {config.format} W/A/KV for the FP4 variants, temperature 1, "
        "no stop token (every sequence decodes the full length). Median of "
        f"{config.repeats} rollouts after a warm-up; compile time excluded. `+ compact`: TRACE's "
        "compact guidance at the deeper half's sites; `+ full`: full codes at every FP4 site."
        + (" SMOKE RUN: tiny sizes; the numbers mean nothing." if config.smoke else "")
        + f"\n\n![tokens/s vs output length]({name}.png)"
    )
    table = harness.write_table(
        name,
        rows,
        [*cols, "compile_s"],
        title="Rollout decode throughput vs output length",
        notes=notes,
        outdir=outdir,
    )
    plot(rows, os.path.join(outdir, f"{name}.png"))
    print(table)
    return rows


def main(argv):
    del argv
    f = flags.FLAGS
    if f.plot_from:
        print(f"wrote {plot_from(f.plot_from)}")
        return
    run(f.config, outdir=f.outdir, name=f.name)


def define_flags() -> None:
    harness.define_config_flag("decode_throughput")
    harness.define_result_flags("decode_throughput")
    flags.DEFINE_string("plot_from", "", "only redraw the PNG of this written JSON")


if __name__ == "__main__":
    define_flags()
    app.run(main)
