"""Does the quantizer give the same bits on the accelerator as on the CPU?

The one float32 operation in `trace_jax.fp4` that is not exact by construction is the reciprocal
of the NVFP4 scales (`scales.reciprocal`). On NVIDIA GPUs both XLA and Pallas' Triton lowering
divide with the approximate `div.full.f32`, so the reciprocal is `numerics.reciprocal_rn`: a
hardware estimate with its last bit settled by integer arithmetic, correctly rounded everywhere.
This script measures, on the default device against the host CPU of the same run:

  reciprocal   float32 1 / d for random d over 2**-60 .. 2**60: XLA and a Pallas kernel on the
               device against numpy's IEEE quotient, and against each other;
  quantize     `fp4.quantize` (RTN) of random bf16 tensors (normal and heavy-tailed Student-t)
               on the device against the same call on the CPU: differing codes, block-scale bits,
               NVFP4 global scales, and the largest dequantized difference;
  sensitivity  on the CPU: NVFP4 quantization, RTN and guided, with every reciprocal moved one
               ulp up (or down) against the IEEE one, an upper bound per reciprocal error of
               what the GPU's `div.full.f32` can change (`scales.reciprocal` patched for the
               call).

On a CPU-only machine the first two compare the CPU with itself (every count must be zero).
Sizes and sections: configs/platform_numerics.py. Writes `<outdir>/<name>.{md,json}` (default
`platform_numerics`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import pallas as pl
from ml_collections import ConfigDict

from experiments import harness
from kernels_pallas import common
from kernels_pallas.fp4_quantize import mosaic as quantize_mosaic
from trace_jax import fp4
from trace_jax.fp4 import scales

_BLOCK = 1024


def divisors(n: int, seed: int = 0) -> np.ndarray:
    """n random float32 divisors, mantissas uniform in [1, 2), exponents in [-60, 60)."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)


def pallas_reciprocal(d: jax.Array, *, interpret: bool) -> jax.Array:
    """`scales.reciprocal` inside a Pallas kernel: float32 [n] (n a multiple of 1024), with the
    estimate the quantize kernel passes where it runs natively (`common.rcp_approx` on a GPU,
    the Mosaic kernel's `reciprocal_estimate` on a TPU); interpreted, the plain division."""
    estimate = None
    if not interpret and common.native_lowering() is common.Lowering.TRITON:
        estimate = common.rcp_approx
    elif not interpret:
        estimate = quantize_mosaic.reciprocal_estimate

    def kernel(d_ref, o_ref):
        o_ref[...] = scales.reciprocal(d_ref[...], estimate)

    spec = pl.BlockSpec((_BLOCK,), lambda i: (i,))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(d.shape, jnp.float32),
        grid=(d.size // _BLOCK,),
        in_specs=[spec],
        out_specs=spec,
        interpret=interpret,
    )(d)


def reciprocal_row(n: int) -> dict:
    d = divisors(n)
    ieee = np.float32(1) / d
    on_device = jnp.asarray(d)
    xla = np.asarray(jax.jit(scales.reciprocal)(on_device))
    interpret = common.native_lowering() is None
    kernel = np.asarray(pallas_reciprocal(on_device, interpret=interpret))
    return {
        "check": "reciprocal",
        "elements": n,
        "xla_vs_ieee": int((xla != ieee).sum()),
        "pallas_vs_ieee": int((kernel != ieee).sum()),
        "pallas_vs_xla": int((kernel != xla).sum()),
    }


def _tensor(kind: str, shape: tuple[int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) if kind == "normal" else rng.standard_t(3, shape)
    return x.astype(jnp.bfloat16)


def quantize_rows(shape: tuple[int, int]) -> list[dict]:
    """`fp4.quantize` on the default device vs the CPU, per tensor kind and format."""
    cpu = jax.devices("cpu")[0]
    rows = []
    for seed, kind in enumerate(("normal", "student_t3")):
        x = _tensor(kind, shape, seed)
        for fmt in (fp4.NVFP4, fp4.MXFP4):
            run = jax.jit(lambda a, f=fmt: fp4.quantize(a, f))
            here = run(jnp.asarray(x))
            there = run(jax.device_put(x, cpu))
            deq_here = np.asarray(fp4.dequantize(here))
            deq_there = np.asarray(jax.jit(fp4.dequantize)(there))
            row = {
                "check": "quantize",
                "tensor": f"{kind} {shape[0]}x{shape[1]} bf16",
                "format": fmt.name,
                "elements": x.size,
                "codes_differ": int((np.asarray(here.codes) != np.asarray(there.codes)).sum()),
                "scales_differ": int(
                    (
                        np.asarray(scales.to_bits(here.scales))
                        != np.asarray(scales.to_bits(there.scales))
                    ).sum()
                ),
                "max_abs_dequantized_diff": float(np.nanmax(np.abs(deq_here - deq_there))),
            }
            if fmt.has_global_scale:
                row["global_scales_differ"] = int(
                    (np.asarray(here.global_scale) != np.asarray(there.global_scale)).sum()
                )
            rows.append(row)
            logging.info("%s", row)
    return rows


@contextlib.contextmanager
def _reciprocal_moved(ulps: int):
    """`scales.reciprocal` returning the IEEE reciprocal moved `ulps` (+1 / -1) ulp.

    JAX's caches are cleared on the way in and out: `fp4.quantize` runs its core as a nested jit
    whose traces would otherwise keep whichever reciprocal they were first traced with."""
    ieee = scales.reciprocal
    toward = jnp.inf if ulps > 0 else 0.0
    jax.clear_caches()
    scales.reciprocal = lambda d, estimate=None: jnp.nextafter(
        ieee(d, estimate), jnp.float32(toward)
    )
    try:
        yield
    finally:
        scales.reciprocal = ieee
        jax.clear_caches()


def sensitivity_rows(shape: tuple[int, int]) -> list[dict]:
    """NVFP4 on the CPU: codes and block scales that change when every reciprocal is one ulp
    up or down, for RTN and for guided rounding (compact guidance from the IEEE RTN rollout of
    the same tensor, which the guided trainer then reproduces exactly with IEEE reciprocals)."""
    cpu = jax.devices("cpu")[0]
    rows = []
    for seed, kind in enumerate(("normal", "student_t3")):
        x = jax.device_put(_tensor(kind, shape, seed), cpu)
        rollout = jax.jit(lambda v: fp4.quantize(v, fp4.NVFP4))(x)
        guidance = fp4.make_guidance(rollout, "compact")
        modes = {
            "rtn": lambda v: fp4.quantize(v, fp4.NVFP4),
            "guided": lambda v, g=guidance: fp4.quantize(
                v, fp4.NVFP4, rounding="guided", guidance=g
            ),
        }
        for mode, quantize in modes.items():

            def quantized(a, quantize=quantize):
                # A new function object each call: jit traces again, under the patch if any (the
                # same `quantize` would reuse its first trace, IEEE reciprocals baked in; the
                # nested jit inside `fp4.quantize` is cleared by `_reciprocal_moved`).
                q = jax.jit(lambda v: quantize(v))(a)
                return np.asarray(q.codes), np.asarray(scales.to_bits(q.scales))

            codes, bits = quantized(x)
            for ulps in (1, -1):
                with _reciprocal_moved(ulps):
                    moved_codes, moved_bits = quantized(x)
                rows.append(
                    {
                        "check": f"sensitivity, {mode}, reciprocals {ulps:+d} ulp",
                        "tensor": f"{kind} {shape[0]}x{shape[1]} bf16",
                        "format": fp4.NVFP4.name,
                        "elements": x.size,
                        "codes_differ": int((moved_codes != codes).sum()),
                        "scales_differ": int((moved_bits != bits).sum()),
                    }
                )
                logging.info("%s", rows[-1])
    return rows


SECTIONS = ("reciprocal", "quantize", "sensitivity")


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Runs `config.sections` and writes `<outdir>/<name>.{md,json}`; returns the rows."""
    sections = tuple(config.sections)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    shape = tuple(config.shape)
    rows = []
    if "reciprocal" in sections:
        rows.append(reciprocal_row(config.reciprocal_elements))
        logging.info("%s", rows[-1])
    if "quantize" in sections:
        rows += quantize_rows(shape)
    if "sensitivity" in sections:
        rows += sensitivity_rows(shape)
    device = jax.devices()[0]
    cols = ["check", "tensor", "format", "elements", "xla_vs_ieee", "pallas_vs_ieee"]
    cols += ["pallas_vs_xla", "codes_differ", "scales_differ", "global_scales_differ"]
    cols += ["max_abs_dequantized_diff"]
    cols = [c for c in cols if any(c in r for r in rows)]  # the sections run
    table = harness.write_table(
        name,
        rows,
        cols,
        title="The quantizer's bits on the device against the CPU",
        notes=(
            f"Device {getattr(device, 'device_kind', device.platform)} against the host CPU of "
            "the same run (module docstring of `experiments/platform_numerics.py`). reciprocal: "
            "counts of float32 1 / d differing from numpy's IEEE quotient, and XLA's from the "
            "Pallas kernel's; quantize: counts of differing codes, scale bits and global scales; "
            "sensitivity (CPU only): NVFP4 codes and block scales that change when every "
            "reciprocal is moved one ulp." + (" SMOKE RUN: small sizes." if config.smoke else "")
        ),
        outdir=outdir,
    )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="platform_numerics", name="platform_numerics")
