r"""FP4 MoE grouped matmul (Pallas) against bf16 `jax.lax.ragged_dot`, at decode and prefill sizes.

Per phase: M = tokens * top_k rows routed at random to G experts, NVFP4 activations times packed
NVFP4 expert weights [G, N, K] with both Pallas program orders ("row_tiles", and "groups" with row
tiles near the mean group size), each checked against the XLA reference on the device; the faster
is reported against bf16 `ragged_dot` over the same shapes. Writes `<outdir>/<name>.{json,md}`
(default `kernels_moe_matmul`). Launch commands: configs/bench_moe_matmul.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental import pallas as pl
from ml_collections import ConfigDict

from experiments import harness
from kernels_pallas.fp4_moe_matmul import api as moe
from kernels_pallas.fp4_moe_matmul.reference import pack_weights
from trace_jax import fp4

COLUMNS = ["phase", "M", "G", "K", "N", "fp4_ms", "fp4_grid", "bf16_ragged_dot_ms", "speedup"]
COLUMNS += ["fp4_rel_err_vs_reference"]


def fp4_matmul(x, packed, sizes, implementation: str, **launch) -> jax.Array:
    """`fp4_moe_matmul` by `implementation` ("xla" | "pallas"), float32 out."""
    return moe.fp4_moe_matmul(
        x, packed, sizes, implementation=implementation, out_dtype=jnp.float32, **launch
    )


def bench(config: ConfigDict) -> list[dict]:
    """One row per phase of `config.phases`."""
    g, d, f = config.experts, config.d_model, config.d_ff
    fmt = fp4.get_format(config.format)
    w = jax.random.normal(jax.random.key(7), (g, f, d), jnp.float32) * 0.02  # [G, N, K]
    packed = pack_weights(w, fmt)
    w_bf16 = jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16)  # [G, K, N] for ragged_dot
    out = []
    for phase, tokens in config.phases:
        m = tokens * config.top_k
        x = jax.random.normal(jax.random.key(8), (m, d), jnp.bfloat16)
        groups = jax.random.randint(jax.random.key(9), (m,), 0, g)
        sizes = jnp.bincount(groups, length=g).astype(jnp.int32)
        xq = fp4.quantize(x, fmt)
        ref = fp4_matmul(xq, packed, sizes, "xla")
        t_bf16 = harness.time_fn(jax.lax.ragged_dot, x, w_bf16, sizes, smoke=config.smoke)
        # Row tiles near the mean group size, at least 16 (Triton's dot minimum).
        block_m = int(max(16, min(64, pl.next_power_of_2(max(1, m // g)))))
        grids = {"row_tiles": {}, "groups": {"block_m": block_m}}
        by_grid, errs = {}, {}
        for grid, extra in grids.items():
            run = functools.partial(fp4_matmul, implementation="pallas", grid=grid, **extra)
            got = run(xq, packed, sizes)
            errs[grid] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            by_grid[grid] = harness.time_fn(run, xq, packed, sizes, smoke=config.smoke)
        best = min(by_grid, key=by_grid.get)
        out.append(
            {
                "op": "moe grouped matmul",
                "fp4_bytes_GB": harness.nbytes(xq, packed) / 1e9,
                "phase": phase,
                "M": m,
                "G": g,
                "K": d,
                "N": f,
                "fp4_ms": 1e3 * by_grid[best],
                "fp4_grid": best,
                "fp4_ms_by_grid": {k: 1e3 * t for k, t in by_grid.items()},
                "bf16_ragged_dot_ms": 1e3 * t_bf16,
                "speedup": t_bf16 / by_grid[best],
                "fp4_rel_err_vs_reference": max(errs.values()),
            }
        )
        logging.info("%s", out[-1])
    return out


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Measures every phase and writes `<outdir>/<name>.{json,md}`; returns the rows."""
    rows = bench(config)
    notes = (
        f"{config.format} activations and weights; `fp4_grid`: the faster Pallas program order "
        "(both are in `fp4_ms_by_grid`); `fp4_rel_err_vs_reference`: the larger of the two "
        "against the XLA reference." + (harness.SMOKE_NOTE if config.smoke else "")
    )
    summary = {"speedup": {r["phase"]: r["speedup"] for r in rows}}
    table = harness.write_table(
        name,
        rows,
        COLUMNS,
        title="FP4 MoE grouped matmul",
        notes=notes,
        outdir=outdir,
        extra={"summary": summary},
    )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="bench_moe_matmul", name="kernels_moe_matmul")
