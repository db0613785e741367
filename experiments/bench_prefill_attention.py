r"""Prefill attention over the KV cache: the flash kernel (`kernels_pallas.prefill_attention`)
against the model's XLA attention (`trace_jax.models.attention.attend` over `cache_mask`, queries
in blocks of `QUERY_BLOCK`), two library flash attentions as the best available baselines, and
the dense bf16 matmul rate of the same run.

Baselines (a chunk of whole prompts from position 0 sees exactly the first P slots, causally,
which is all they can express): `cudnn`, `jax.nn.dot_product_attention(implementation="cudnn",
is_causal=True)` over those slots (grouped heads natively; the model's `prefill_attention="cudnn"`,
`attention.causal_prefix_attention`); `jax_mha`, jax's own Pallas Triton
flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`, deprecated in favour of
tokamax, which does not run on this jax), K/V repeated to the query heads outside it (that copy
timed with it). A baseline that fails (no cuDNN, an unsupported shape) is a row with its error.

Per shape (rows, prompt tokens P, new slots): a chunk of whole prompts at positions 0..P-1 in a
cache of P + new slots, bf16 q [rows, P, Hkv, G, Dh] and k, v. Every kernel tiling of
`config.tilings` is timed (`timing.time_fn`; a tiling that fails is recorded with its error and
skipped); the fastest and XLA's attention are then timed in alternating rounds
(`timing.time_interleaved`, medians). `tflops`: the causal pairs' FLOPs (4 Dh per query head and
visible slot) over the time; `frac_of_dense`: of the dense bf16 rate measured here;
`speedup_vs_xla`: XLA's time over this one; `rel_err`: Frobenius norm against XLA's output.
Writes `<outdir>/<name>.{json,md}` (default `kernels_prefill_attention`). Launch commands:
configs/bench_prefill_attention.py.
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
from absl import logging
from ml_collections import ConfigDict

from experiments import harness, timing
from kernels_pallas import common as kernel_common
from kernels_pallas.prefill_attention import prefill_attention
from trace_jax.models.attention import (
    QUERY_BLOCK,
    attend,
    cache_mask,
    causal_prefix_attention,
)

COLUMNS = ["rows", "prompt", "slots", "kernel", "ms", "tflops", "frac_of_dense"]
COLUMNS += ["speedup_vs_xla", "rel_err", "tiling", "error"]


def operands(config: ConfigDict, rows: int, prompt: int, new: int) -> tuple:
    """bf16 q [rows, P, Hkv, G, Dh], k and v [rows, P + new, Hkv, Dh], positions 0..P-1 and
    kv lengths P."""
    hkv, g, dh = config.kv_heads, config.q_per_kv, config.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (rows, prompt, hkv, g, dh), jnp.bfloat16)
    k = jax.random.normal(kk, (rows, prompt + new, hkv, dh), jnp.bfloat16)
    v = jax.random.normal(kv, (rows, prompt + new, hkv, dh), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (rows, prompt))
    return q, k, v, positions, jnp.full((rows,), prompt, jnp.int32)


def xla_attention(q, k, v, positions, kv_lengths):
    """The model's attention of a prefill chunk over the cache (`Attention` with a cache)."""
    mask = cache_mask(positions, kv_lengths, k.shape[1])
    return attend(q, k, v, mask, query_block=QUERY_BLOCK)


def cudnn_attention(q, k, v, positions, kv_lengths):
    """cuDNN's fused attention over the first P slots, causal (whole prompts from position 0):
    the model's `prefill_attention="cudnn"` path."""
    del positions, kv_lengths
    return causal_prefix_attention(q, k, v)


def jax_mha_attention(q, k, v, positions, kv_lengths, *, interpret: bool = False):
    """jax's Pallas Triton flash attention over the first P slots, causal, K/V heads repeated."""
    from jax.experimental.pallas.ops.gpu import attention as jax_attention

    del positions, kv_lengths
    b, p, hkv, g, dh = q.shape
    k, v = (jnp.repeat(a[:, :p], g, axis=2) for a in (k, v))  # [B, P, H, Dh]
    out = jax_attention.mha(
        q.reshape(b, p, hkv * g, dh), k, v, None, sm_scale=dh**-0.5, causal=True,
        interpret=interpret,
    )  # fmt: skip
    return out.reshape(q.shape)


def causal_flops(config: ConfigDict, rows: int, prompt: int) -> float:
    """q . k and p . v over the visible (query, slot) pairs: 4 Dh FLOPs per query head and pair."""
    heads = config.kv_heads * config.q_per_kv
    return 4.0 * config.head_dim * heads * rows * prompt * (prompt + 1) / 2


def relative_error(out: jax.Array, ref: jax.Array) -> float:
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def measure_shape(config: ConfigDict, rows: int, prompt: int, new: int, dense_s: float):
    """(rows of the table, the tiling sweep) of one shape."""
    ops = operands(config, rows, prompt, new)
    ref = jax.jit(xla_attention)(*ops)
    sweep, best = [], None
    for tiling in map(dict, config.tilings):
        fn = functools.partial(prefill_attention, implementation="pallas", **tiling)
        try:
            err = relative_error(jax.jit(fn)(*ops), ref)
            ms = 1e3 * timing.time_fn(fn, *ops, inner=5, trials=3, warmup=2, smoke=config.smoke)
            sweep.append({"tiling": tiling, "ms": ms, "rel_err": err})
            if best is None or ms < best[0]["ms"]:
                best = (sweep[-1], fn)
        # A tiling that does not compile or fit (shared memory, registers) is a result of the
        # sweep, not its end.
        except Exception as e:
            sweep.append({"tiling": tiling, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        logging.info("pallas %s: %s", tiling, sweep[-1])
    calls = {"xla": (xla_attention, ops)}
    if best is not None:
        calls["pallas"] = (best[1], ops)
    interpret = kernel_common.native_lowering() is None  # the smoke run: Pallas interpreted
    baselines = {
        "cudnn": cudnn_attention,
        "jax_mha": functools.partial(jax_mha_attention, interpret=interpret),
    }
    errors = {}
    for name, fn in baselines.items():
        try:  # compiled and checked here; a failure is a row with its error
            errors[name] = relative_error(jax.jit(fn)(*ops), ref)
            calls[name] = (fn, ops)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            logging.info("%s: %s", name, errors[name])
    trials = dict(inner=1, trials=1, warmup=1) if config.smoke else dict(inner=5, trials=3)
    by_round = timing.time_interleaved(calls, rounds=config.rounds, **trials)
    ms = {name: 1e3 * statistics.median(t) for name, t in by_round.items()}
    flops = causal_flops(config, rows, prompt)
    dense_tflops = 2 * config.dense_size**3 / dense_s / 1e12
    table = []
    for name in ("xla", "pallas", *baselines):
        row = {"rows": rows, "prompt": prompt, "slots": prompt + new, "kernel": name}
        if name not in ms:
            failed = "every tiling failed (see the sweep)" if name == "pallas" else errors[name]
            table.append({**row, "error": failed})
            continue
        row |= {"ms": ms[name], "ms_by_round": [1e3 * t for t in by_round[name]]}
        row["tflops"] = flops / (ms[name] / 1e3) / 1e12
        row["frac_of_dense"] = row["tflops"] / dense_tflops
        row["speedup_vs_xla"] = ms["xla"] / ms[name]
        if name == "pallas":
            row |= {"rel_err": best[0]["rel_err"], "tiling": best[0]["tiling"]}
        elif name in baselines:
            row["rel_err"] = errors[name]
        table.append(row)
    return table, sweep


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Times every shape of `config.shapes`, writes `<outdir>/<name>.{json,md}`, returns rows."""
    n = config.dense_size
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    dense_s = timing.time_fn(jnp.matmul, a, a, smoke=config.smoke)
    rows, sweeps = [], {}
    for shape in config.shapes:
        table, sweeps[str(tuple(shape))] = measure_shape(config, *shape, dense_s)
        rows += table
    dense_tflops = 2 * n**3 / dense_s / 1e12
    notes = (
        f"bf16, {config.kv_heads * config.q_per_kv} query heads over {config.kv_heads} kv heads "
        f"of {config.head_dim}; a chunk of whole prompts from position 0. `ms`: median over "
        "alternating rounds; `tflops`: causal FLOPs (4 Dh per query head and visible slot) over "
        f"the time; `frac_of_dense`: of the dense bf16 matmul rate of this run ({dense_tflops:.0f}"
        " TFLOP/s); `rel_err`: against XLA's output; `tiling`: the fastest of the kernel's sweep "
        "(every entry in the JSON's `sweep`, `{}` = its defaults)."
        + (harness.SMOKE_NOTE if config.smoke else "")
    )
    table = harness.write_table(
        name,
        rows,
        COLUMNS,
        title="Prefill attention over the KV cache: flash kernel and XLA",
        notes=notes,
        outdir=outdir,
        extra={"dense_tflops": dense_tflops, "sweep": sweeps},
    )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="bench_prefill_attention", name="kernels_prefill_attention")
