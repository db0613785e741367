r"""Where the fused quantize + capture kernel's time goes: the kernel cut down stage by stage.

Nsight Compute does not run under JAX on the device machine, so, as for decode attention, the
split comes from timing the production launch (`kernels_pallas.fp4_quantize.kernel
.quantize_capture_pallas` with the api's column tiles, 4 rows x 1024 columns, unless the config
says otherwise) with its body cut after each stage. Every stage reads the whole tile and writes
every output byte the kernel writes (codes, scale bits, compact bits), so the bytes moved are the
same in every row:

  io      the tile read and its row sums broadcast into the outputs: the memory floor;
  scales  + each block's max |x| and scale bits (`scales.block_scale_bits`, written for real) and
          x divided by its scales (`scales.normalize`); the codes' outputs still row sums;
  round   + round to nearest even on the FP4 grid and the code encoding (`quantize_core`, the
          quantizer itself); codes summed per row, not packed;
  full    the production body (+ packing two codes per byte and eight compact bits per byte, pairs
          joined by halving);

and `full` again with the other packing (`pack="sum"`: shifted fields summed over a trailing
axis, a reduction Triton may lower with layout conversions; 2-5% slower than the halving pairs
on the H200).

NVFP4's global scale is computed beforehand (by XLA, as the api does for column tiles) and passed
in, outside the timed call. Beside the stages, the api's own default launch of each format (for
wide NVFP4 rows a row loop with the global scale inside the kernel, `api.default_launch`). And a
device copy of the input (the copy bandwidth the kernels are measured against). Sizes:
configs/quantize_ablation.py. Writes `<outdir>/<name>.{md,json}` (default `quantize_ablation`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from ml_collections import ConfigDict

from experiments import harness, timing
from kernels_pallas import common
from kernels_pallas.fp4_quantize import api
from kernels_pallas.fp4_quantize import kernel as K
from trace_jax import fp4
from trace_jax.fp4 import scales
from trace_jax.fp4.quantize import quantize_core

STAGES = ("io", "scales", "round", "full")
# The packing the `full` row is timed with again, beside the production one.
ALT_PACK = next(p for p in K.PACKINGS if p != K.DEFAULT_PACK)
COLUMNS = ["format", "variant", "ms", "added_ms", "fraction_of_copy"]


def api_quantize(x: jax.Array, fmt: fp4.BlockFormat, implementation: str):
    """The quantize op through its api ("xla": the reference; "pallas": the default launch)."""
    return api.fp4_quantize(x, fmt, implementation=implementation)


def _fill(ref, per_row: jax.Array) -> None:
    """Writes a [rows, 1] value into every column of `ref` (the output's bytes, cheaply)."""
    ref[...] = jnp.broadcast_to(per_row.astype(jnp.int32).astype(ref.dtype), ref.shape)


def _stage_body(stage: str):
    """A kernel body with the production body's refs and keyword arguments doing `stage`'s work
    (RTN, no guidance, the whole tile at once)."""

    def body(*refs, fmt, guide_mode, s_g_given, loop_n, inline_asm):
        # The reciprocal's estimate as in the production body (`reciprocal_rn`'s platform-dependent
        # default does not lower to Triton).
        est = common.rcp_approx if inline_asm else None
        if guide_mode is not None or loop_n is not None:
            raise ValueError("the ablation times RTN quantization of whole tiles only")
        refs = list(refs)
        x_ref = refs.pop(0)
        sg_ref = refs.pop(0) if s_g_given else None
        codes_ref, bits_ref, cbits_ref, *gs_ref = refs
        x = x_ref[...].astype(jnp.float32)
        rows, n = x.shape
        s_g = sg_ref[...] if s_g_given else None
        if fmt.has_global_scale and s_g is None:  # whole rows: the row's own, as production does
            s_g = scales.global_scale_from_amax(jnp.max(jnp.abs(x), axis=1, keepdims=True), fmt)
        if stage == "io":
            keep = jnp.sum(x, axis=1, keepdims=True)
            _fill(bits_ref, keep)
        elif stage == "scales":
            xb = x.reshape(rows, n // fmt.block_size, fmt.block_size)
            bits = scales.block_scale_bits(xb, fmt, s_g, estimate=est)
            z = scales.normalize(xb, bits, s_g, fmt, estimate=est)
            keep = jnp.sum(z.reshape(rows, n), axis=1, keepdims=True)
            bits_ref[...] = bits
        elif stage == "round":
            codes, bits, _ = quantize_core(x, fmt, s_g=s_g, reciprocal_estimate=est)
            keep = jnp.sum(codes.astype(jnp.int32), axis=1, keepdims=True)
            bits_ref[...] = bits
        else:
            raise ValueError(f"unknown stage {stage!r}")
        _fill(codes_ref, keep)
        _fill(cbits_ref, keep)
        for ref in gs_ref:  # whole rows only
            ref[...] = s_g if s_g is not None else jnp.ones(ref.shape, jnp.float32)

    return body


BODIES = {stage: _stage_body(stage) for stage in STAGES[:-1]} | {"full": None}


@functools.partial(
    jax.jit, static_argnames=("fmt", "stage", "block_r", "block_n", "interpret", "pack")
)
def run_stage(
    x: jax.Array,
    s_g: jax.Array | None,
    *,
    fmt: fp4.BlockFormat,
    stage: str,
    block_r: int,
    block_n: int,
    interpret: bool,
    pack: str = K.DEFAULT_PACK,
) -> list[jax.Array]:
    """The quantize kernel's launch over `x [R, N]` bf16 with `stage`'s body -> its outputs
    (packed codes, scale bits, compact bits; only "full" is the quantization, the others write
    what keeps their work alive). `s_g` float32 [R, 1]: NVFP4's global scales, else None.
    `pack`: the production body's packing ("full" only)."""
    return K.quantize_capture_pallas(
        x,
        fmt,
        block_r=block_r,
        block_n=block_n,
        s_g=s_g,
        interpret=interpret,
        body=BODIES[stage],
        pack=pack,
    )


def _launch_name(fmt: fp4.BlockFormat, n: int) -> str:
    """The API's default launch for rows of width `n`, in words."""
    block_r, block_n, loop_n = api.default_launch(fmt, n)
    if loop_n:
        return f"{block_r}-row programs, {loop_n}-column chunks, global scale in the kernel"
    if block_n:
        extra = ", incl. XLA's global-scale pass" if fmt.has_global_scale else ""
        return f"{block_r} x {block_n} column tiles{extra}"
    return "whole rows"


def bench(config: ConfigDict) -> list[dict]:
    """The copy, then per format every stage, the other packing and the api's default launch."""
    rows_n, n, smoke = config.rows, config.cols, config.smoke
    block_r = config.block_rows or api.COLUMN_TILE_ROWS
    block_n = config.block_cols or api.COLUMN_TILE
    interpret = jax.default_backend() != "gpu"
    x = jax.random.normal(jax.random.key(2), (rows_n, n), jnp.bfloat16)
    t_copy = timing.time_fn(lambda a: a + jnp.asarray(1, a.dtype), x, smoke=smoke)
    copy_bw = 2 * harness.nbytes(x) / t_copy
    out = [{"format": "n/a", "variant": "copy of x", "ms": 1e3 * t_copy, "fraction_of_copy": 1.0}]
    for fmt in (fp4.MXFP4, fp4.NVFP4):
        want = api_quantize(x, fmt, "xla")
        moved = harness.nbytes(x) + harness.nbytes(want)  # as `bench_quantize` counts them
        s_g = None
        if fmt.has_global_scale:
            s_g = scales.global_scale(x.astype(jnp.float32), fmt, (1,))
        run = functools.partial(
            run_stage, fmt=fmt, block_r=block_r, block_n=block_n, interpret=interpret
        )
        # (row name, stage, packing); each `full` row's outputs are checked against the API's.
        variants = [(f"{fmt.name} {s}", s, K.DEFAULT_PACK) for s in STAGES]
        variants += [(f"{fmt.name} full, {ALT_PACK} packing", "full", ALT_PACK)]
        prev = None
        for name, stage, pack in variants:
            try:
                if stage == "full":
                    packed, bits, cbits, *_ = run(x, s_g, stage="full", pack=pack)
                    for got, ref in ((packed, want.packed_codes), (cbits, want.compact_bits),
                                     (bits, scales.to_bits(want.scales))):  # fmt: skip
                        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
                timed = functools.partial(run, stage=stage, pack=pack)
                t = timing.time_fn(timed, x, s_g, smoke=smoke)
            except Exception as e:  # a body Triton cannot lower must not lose the other rows
                logging.exception("%s failed", name)
                out.append({"format": fmt.name, "variant": name, "error": repr(e)[:300]})
                prev = None
                continue
            out.append(
                {
                    "format": fmt.name,
                    "variant": name,
                    "ms": 1e3 * t,
                    **({"added_ms": 1e3 * (t - prev)} if prev and pack == K.DEFAULT_PACK else {}),
                    "fraction_of_copy": moved / t / copy_bw,
                }
            )
            prev = t if pack == K.DEFAULT_PACK else None
            logging.info("%s", out[-1])
        t = timing.time_fn(lambda a, f=fmt: api_quantize(a, f, "pallas"), x, smoke=smoke)
        out.append(
            {
                "format": fmt.name,
                "variant": f"{fmt.name} API ({_launch_name(fmt, n)})",
                "ms": 1e3 * t,
                "fraction_of_copy": moved / t / copy_bw,
            }
        )
    return out


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Times every variant and writes `<outdir>/<name>.{md,json}`; returns the rows."""
    rows = bench(config)
    cols = COLUMNS + (["error"] if any("error" in r for r in rows) else [])
    table = harness.write_table(
        name,
        rows,
        cols,
        title="FP4 quantize + capture, cut down stage by stage",
        notes=(
            f"Input {config.rows} x {config.cols} bf16, RTN, the api's column tiles unless the "
            "config sets the tile. Each stage row is the production launch with the kernel body "
            "cut after that stage (module docstring of `experiments/quantize_ablation.py`); "
            "`added_ms`: over the row above; `fraction_of_copy`: the bytes the kernel moves over "
            "the time, against the copy's bandwidth in the same run."
            + (harness.SMOKE_NOTE if config.smoke else "")
        ),
        outdir=outdir,
    )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="quantize_ablation", name="quantize_ablation")
