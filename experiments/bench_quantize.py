r"""Fused FP4 quantize + capture (Pallas) against the XLA quantizer and a copy of the same input.

Every launch of `config.launches` (rows per program, column tile, warps, row-loop chunk) is timed
on `rows x cols` bf16 per format, each checked bit for bit against the XLA quantizer on the device
first; `fastest` marks the quickest Pallas launch per format, the one the summary reports. Each
row's `bandwidth_fraction_of_copy` is the bytes the op moves (input read, codes, scales and
compact bits written) over its time, against the copy bandwidth of the same run
(`harness.ceilings`). Writes `<outdir>/<name>.{json,md}` (default `kernels_quantize`). Launch
commands: configs/bench_quantize.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from ml_collections import ConfigDict

from experiments import harness, timing
from kernels_pallas.fp4_quantize import fp4_quantize
from trace_jax import fp4

COLUMNS = ["op", "format", "implementation", "launch", "shape", "ms", "copy_ms"]
COLUMNS += ["bandwidth_fraction_of_copy"]


def quantize(x: jax.Array, fmt: fp4.BlockFormat, implementation: str, **launch):
    """`fp4_quantize` of `x` by `implementation` ("xla" | "pallas") with `launch`'s keywords."""
    return fp4_quantize(x, fmt, implementation=implementation, **launch)


def launch_label(block_r: int | None, block_n: int | None, warps: int, loop_n: int | None) -> str:
    """A launch in words: "b<rows>[x<column tile>][ loop<chunk>] w<warps>"."""
    label = f"b{block_r or 'default'}" + (f"x{block_n}" if block_n else "")
    return label + (f" loop{loop_n}" if loop_n else "") + f" w{warps}"


def mark_fastest(rows: list[dict]) -> list[dict]:
    """`rows` (timed launches of one op, `ms` each) with `fastest` True on the quickest only."""
    best = min(range(len(rows)), key=lambda i: rows[i]["ms"])
    return [{**r, "fastest": i == best} for i, r in enumerate(rows)]


def bench(config: ConfigDict, copy_bw: float) -> list[dict]:
    """One row per (format, Pallas launch) and one per format for the XLA quantizer; `copy_bw`
    bytes/s (`harness.ceilings`)."""
    smoke = config.smoke
    x = jax.random.normal(jax.random.key(2), (config.rows, config.cols), jnp.bfloat16)
    t_copy = timing.time_fn(lambda a: a + jnp.asarray(1, a.dtype), x, smoke=smoke)
    out = []
    for fmt in map(fp4.get_format, config.formats):
        ref = jax.jit(lambda a, f=fmt: quantize(a, f, "xla"))(x)
        moved = harness.nbytes(x) + harness.nbytes(ref)

        def row(implementation, t, launch="n/a", f=fmt, moved=moved):
            return {
                "op": "quantize+capture",
                "format": f.name,
                "implementation": implementation,
                "launch": launch,
                "shape": f"{config.rows}x{config.cols} bf16",
                "ms": 1e3 * t,
                "copy_ms": 1e3 * t_copy,
                "bandwidth_fraction_of_copy": moved / t / copy_bw,
            }

        sweep = []
        for block_r, block_n, warps, loop_n in config.launches:
            if (block_n or loop_n or 0) >= config.cols:
                continue
            kw = dict(block_r=block_r, block_n=block_n, num_warps=warps, loop_n=loop_n)
            run = jax.jit(lambda a, f=fmt, kw=kw: quantize(a, f, "pallas", **kw))
            for u, v in zip(jax.tree.leaves(run(x)), jax.tree.leaves(ref), strict=True):
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
            t = timing.time_fn(run, x, smoke=smoke)
            sweep.append(row("pallas", t, launch_label(block_r, block_n, warps, loop_n)))
        out += mark_fastest(sweep)
        t = timing.time_fn(lambda a, f=fmt: quantize(a, f, "xla"), x, smoke=smoke)
        out.append(row("xla", t))
        logging.info("%s", out[-len(sweep) - 1 :])
    return out


def summarize(rows: list[dict], ceil: dict[str, float]) -> dict:
    """The run's ceilings (GB/s) and, per format, the fastest Pallas launch's fraction of copy
    bandwidth."""
    return {
        "read_bw_GBps": ceil["read_bw"] / 1e9,
        "copy_bw_GBps": ceil["copy_bw"] / 1e9,
        "bandwidth_fraction": {
            r["format"]: r["bandwidth_fraction_of_copy"]
            for r in rows
            if r["implementation"] == "pallas" and r["fastest"]
        },
    }


def notes(summary: dict, smoke: bool) -> str:
    return (
        "Each Pallas launch is checked bit for bit against the XLA quantizer on the device before "
        "it is timed; `fastest` marks the quickest launch per format. `bandwidth_fraction_of_copy`"
        ": bytes read and written over the time, against the copy bandwidth of the same run "
        f"({summary['copy_bw_GBps']:.0f} GB/s; read {summary['read_bw_GBps']:.0f} GB/s)."
        + (harness.SMOKE_NOTE if smoke else "")
    )


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Measures the ceilings and every launch, writes `<outdir>/<name>.{json,md}`; returns the
    rows."""
    ceil = harness.ceilings(config.ceiling_bytes, smoke=config.smoke)
    logging.info("ceilings %s", ceil)
    rows = bench(config, ceil["copy_bw"])
    summary = summarize(rows, ceil)
    table = harness.write_table(
        name,
        rows,
        COLUMNS,
        title="FP4 quantize + capture",
        notes=notes(summary, config.smoke),
        outdir=outdir,
        extra={"summary": summary},
    )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="bench_quantize", name="kernels_quantize")
