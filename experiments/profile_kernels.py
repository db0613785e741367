r"""Launches each FP4 kernel a few times at the shapes where its goal is missed, for a profiler.

Under Nsight Compute on the GPU (one profiled launch per kernel, after warm-up launches; the
command is in configs/profile_kernels.py), `ncu_details.csv` says per kernel where its time goes
(achieved DRAM bandwidth, issue-slot and pipe utilisation, stall reasons, shared-memory traffic of
layout conversions). Kernels: FP4 decode attention (default launch) and its bf16 twin at the
paper-like shape (batch 16, 32 query / 4 KV heads, head_dim 128, 32K context), and the fused
quantize + capture kernel for NVFP4 and MXFP4 on 65536 x 4096 bf16. Every output is checked
against the XLA reference before the profiled launches. The smoke config runs tiny shapes on the
CPU in interpret mode (no profile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import ConfigDict

from experiments import harness
from kernels_pallas.fp4_decode_attention import api as attn
from kernels_pallas.fp4_quantize import fp4_quantize
from trace_jax import fp4


def kernels_and_references(config: ConfigDict) -> dict[str, tuple]:
    """name -> (kernel, its XLA reference, arguments): the Pallas kernels as compiled for the
    profile, each with the op's reference implementation."""
    b, h, hkv, dh, ctx = (
        config.batch,
        config.heads,
        config.kv_heads,
        config.head_dim,
        config.context,
    )
    k, v = harness.random_kv(b, ctx, hkv, dh, seed=ctx)
    q = jax.random.normal(jax.random.key(5), (b, h, dh), jnp.bfloat16)
    lengths = jnp.full((b,), ctx, jnp.int32)
    kc, vc = harness.packed_kv_cache(k, fp4.NVFP4), harness.packed_kv_cache(v, fp4.NVFP4)
    x = jax.random.normal(jax.random.key(2), (config.rows, config.cols), jnp.bfloat16)
    runs = {}
    for impl in ("pallas", "xla"):  # the kernel, then its reference
        runs.setdefault("fp4_decode_attn", []).append(
            functools.partial(attn.fp4_decode_attention, implementation=impl)
        )
        runs.setdefault("bf16_decode_attn", []).append(
            functools.partial(attn.bf16_decode_attention, implementation=impl)
        )
        for fmt in (fp4.NVFP4, fp4.MXFP4):
            runs.setdefault(f"fp4_quantize {fmt.name}", []).append(
                functools.partial(fp4_quantize, fmt=fmt, implementation=impl)
            )
    args = {"fp4_decode_attn": (q, kc, vc, lengths), "bf16_decode_attn": (q, k, v, lengths)}
    return {
        name: (jax.jit(kernel), jax.jit(reference), args.get(name, (x,)))
        for name, (kernel, reference) in runs.items()
    }


def launch_all(config: ConfigDict) -> dict[str, float]:
    """Runs every kernel `config.launches` times after checking it; returns each one's max
    relative error against its XLA reference."""
    errors = {}
    for name, (kernel, reference, args) in kernels_and_references(config).items():
        got, want = kernel(*args), reference(*args)
        errs = []
        for u, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            u, w = np.asarray(u, np.float64), np.asarray(w, np.float64)
            errs.append(np.abs(u - w).max() / max(np.abs(w).max(), 1e-30))
        errors[name] = float(max(errs))
        for _ in range(config.launches):
            jax.block_until_ready(kernel(*args))
        logging.info(
            "%s: %d launches, max relative error vs XLA %.2e", name, config.launches, errors[name]
        )
    return errors


def main(argv):
    del argv
    config = flags.FLAGS.config
    if config.smoke:
        jax.config.update("jax_platforms", "cpu")
    with harness.smoke_interpretation(config):
        errors = launch_all(config)
    for name, err in errors.items():
        print(f"{name}: max relative error vs XLA reference {err:.2e}")


def define_flags() -> None:
    harness.define_config_flag("profile_kernels")


if __name__ == "__main__":
    define_flags()
    app.run(main)
