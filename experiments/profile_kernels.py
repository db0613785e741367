r"""Launches each FP4 kernel a few times at the shapes where its goal is missed, for a profiler.

Under Nsight Compute on the GPU (one profiled launch per kernel, after warm-up launches):

  ncu --kernel-name regex:'fp4_decode_attn|bf16_decode_attn|fp4_quantize' --launch-skip 2 \
      --launch-count 3 --set detailed --csv --page details \
      python -m experiments.profile_kernels > ncu_details.csv

`ncu_details.csv` then says, per kernel, where its time goes (achieved DRAM bandwidth, issue-slot
and pipe utilisation, stall reasons, shared-memory traffic of layout conversions): the evidence the
next optimisation of `kernels_findings.md` needs. Kernels: FP4 decode attention (default launch)
and its bf16 twin at the paper-like shape (batch 16, 32 query / 4 KV heads, head_dim 128, 32K
context), and the fused quantize + capture kernel for NVFP4 and MXFP4 on 65536 x 4096 bf16. Every
output is checked against the XLA reference before the profiled launches. `--quick`: tiny shapes
in interpret mode (a CPU smoke run of the script; no profile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments.bench_kernels import _key, _kv, _packed
from kernels_pallas.fp4_decode_attention import api as attn
from kernels_pallas.fp4_quantize import fp4_quantize
from trace_jax import fp4

LAUNCHES = 5  # per kernel: the ncu command above skips 2 and profiles 3


def launch_all(quick: bool) -> dict[str, float]:
    """Runs every kernel `LAUNCHES` times after checking it; returns each one's max relative
    error against its XLA reference."""
    b, h, hkv, dh, ctx = (2, 4, 2, 64, 256) if quick else (16, 32, 4, 128, 32768)
    k, v = _kv(b, ctx, hkv, dh, seed=ctx)
    q = jax.random.normal(_key(5), (b, h, dh), jnp.bfloat16)
    lengths = jnp.full((b,), ctx, jnp.int32)
    kc, vc = _packed(k, fp4.NVFP4), _packed(v, fp4.NVFP4)
    runs = {
        "fp4_decode_attn": (
            lambda: attn.fp4_decode_attention(q, kc, vc, lengths, backend="pallas"),
            lambda: attn.fp4_decode_attention(q, kc, vc, lengths, backend="xla"),
        ),
        "bf16_decode_attn": (
            lambda: attn.bf16_decode_attention(q, k, v, lengths, backend="pallas"),
            lambda: attn.bf16_decode_attention(q, k, v, lengths, backend="xla"),
        ),
    }
    rows, n = (256, 256) if quick else (65536, 4096)
    x = jax.random.normal(_key(2), (rows, n), jnp.bfloat16)
    for fmt in (fp4.NVFP4, fp4.MXFP4):
        runs[f"fp4_quantize {fmt.name}"] = (
            jax.jit(lambda a, f=fmt: fp4_quantize(a, f, backend="pallas")).lower(x).compile(),
            jax.jit(lambda a, f=fmt: fp4_quantize(a, f, backend="xla")),
        )
    errors = {}
    for name, (kernel, reference) in runs.items():
        args = (x,) if name.startswith("fp4_quantize") else ()
        got, want = kernel(*args), reference(*args)
        errs = []
        for u, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            u, w = np.asarray(u, np.float64), np.asarray(w, np.float64)
            errs.append(np.abs(u - w).max() / max(np.abs(w).max(), 1e-30))
        errors[name] = float(max(errs))
        for _ in range(LAUNCHES):
            jax.block_until_ready(kernel(*args))
        logging.info(
            "%s: %d launches, max relative error vs XLA %.2e", name, LAUNCHES, errors[name]
        )
    return errors


def main(argv):
    del argv
    if flags.FLAGS.quick:
        jax.config.update("jax_platforms", "cpu")
    for name, err in launch_all(flags.FLAGS.quick).items():
        print(f"{name}: max relative error vs XLA reference {err:.2e}")


if __name__ == "__main__":
    flags.DEFINE_bool("quick", False, "tiny shapes on the CPU, interpret mode (smoke run)")
    app.run(main)
