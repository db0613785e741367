r"""Grouped expert matmul at decode and prefill sizes: bf16 XLA baselines, the bf16 and FP4 Pallas
kernels over their block configs, against the dense bf16 rate and the read bandwidth.

Per phase (M rows routed at random to G experts, uniformly or skewed by `config.routing_skew`,
`[M, K] x [G, N, K]`), side by side:
  ragged_dot     bf16 `jax.lax.ragged_dot` (XLA; densifies over the experts on a GPU)
  tiled          bf16 `trace_jax.models.grouped_matmul.tiled_ragged_dot` (XLA)
  pallas_bf16    `kernels_pallas.grouped_matmul` (bf16 weights)
  fp4_bf16_act   `kernels_pallas.fp4_moe_matmul`, packed NVFP4 weights, bf16 activations
  fp4_nvfp4_act  the same with NVFP4 activations
  fp4_*_predecoded  the same two with the weights decoded before the call (`predecode=True`,
                 the bf16 kernel's grid over them), which the op picks by default from
                 `PREDECODE_MIN_ROWS_PER_GROUP` rows per expert; the two above run
                 `predecode=False`, the kernel's in-kernel decode
  dense_bf16     `[M, K] x [K, N]` in bf16: the same FLOPs, the machine's matmul rate
And once, the predecoded kernels' first step alone (phase `weights_decode`): the packed weights
decoded to float16 and to bfloat16 by one XLA fusion (`decode_xla_*`, `predecoded.
decoded_weights`) and by the Pallas pass the kernels run (`decode_pallas_*`, `predecoded.
decode_weights`), side by side, against the copy bandwidth (codes and scales read, 2 bytes a
value written), the Pallas pass's output checked bit for bit against the XLA fusion's.
Each Pallas kernel runs every block config of `config.block_configs.<phase>.<kernel>` (timed with
`timing.time_fn`; a config that fails to compile or run, e.g. past Triton's shared memory, is
recorded with its error and skipped); the best config per kernel and the baselines are then timed
in alternating rounds (`timing.time_interleaved`, medians over rounds), and then each inside one
device loop of calls chained one after another (`timing.time_in_device_loop`: `loop_ms`, without
the host's per-call dispatch, which floors the per-call times of decode-size calls; `loop_floor_ms`
is the loop's own cost per call). Every output is checked
against the float32 product of the same operands (the tiled form at HIGHEST precision on
dequantized values). Byte limit: the bytes a kernel must move (weights of the experts with rows +
activations + the bf16 output) over the read bandwidth measured in the run (`harness.ceilings`).
Writes `<outdir>/<name>.{json,md}` (default `kernels_moe_matmul`); the JSON keeps every sweep
entry. Launch commands: configs/bench_moe_matmul.py.
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
from absl import logging
from ml_collections import ConfigDict

from experiments import harness, timing
from kernels_pallas import common
from kernels_pallas.fp4_moe_matmul import (
    dequantize_lhs,
    dequantize_weights,
    fp4_moe_matmul,
    pack_weights,
    predecoded,
)
from kernels_pallas.grouped_matmul import grouped_matmul
from trace_jax import fp4
from trace_jax.models.grouped_matmul import tiled_ragged_dot

FP4 = ("fp4_bf16_act", "fp4_nvfp4_act")
PREDECODED = tuple(f"{name}_predecoded" for name in FP4)
SWEPT = ("pallas_bf16", *FP4, *PREDECODED)
# The argument a kernel's device loop carries (`timing.device_loop_times`; the activations
# otherwise): the predecoded kernels decode the packed weights in every call, a pass over
# arguments the loop would not change, which XLA hoists out of the loop unless it carries them.
LOOP_CARRY_ARG = {name: 1 for name in PREDECODED}
KERNELS = ("ragged_dot", "tiled", *SWEPT)
DENSE = "dense_bf16"
COLUMNS = ["phase", "M", "kernel", "ms", "tflops", "frac_of_dense", "byte_limit_ms"]
COLUMNS += ["byte_limit_ratio", "loop_ms", "loop_byte_limit_ratio", "vs_ragged_dot", "rel_err"]
COLUMNS += ["block_config"]


def weights(config: ConfigDict) -> jax.Array:
    """float32 `[G, N, K]` normal weights times 0.02 (the same in every phase)."""
    g, k, n = config.experts, config.d_model, config.d_ff
    return jax.random.normal(jax.random.key(7), (g, n, k), jnp.float32) * 0.02


def operands(config: ConfigDict, m: int) -> dict:
    """Random operands of one phase: x bf16 [M, K], w_nk bf16 [G, N, K] (w_kn its [G, K, N]),
    packed NVFP4 weights, NVFP4 activations, and group sizes of M rows routed at random:
    uniformly (`config.routing_skew` 0), else expert e with probability proportional to
    (e + 1) ** -routing_skew (Zipf: a router that sends many rows to a few experts)."""
    g, k = config.experts, config.d_model
    w = weights(config)
    x = jax.random.normal(jax.random.key(8), (m, k), jnp.bfloat16)
    skew = config.get("routing_skew", 0.0)
    if skew:
        logits = -skew * jnp.log(jnp.arange(1, g + 1, dtype=jnp.float32))
        groups = jax.random.categorical(jax.random.key(9), logits, shape=(m,))
    else:
        groups = jax.random.randint(jax.random.key(9), (m,), 0, g)
    w_nk = w.astype(jnp.bfloat16)
    return {
        "x": x,
        "xq": jax.jit(fp4.quantize, static_argnums=1)(x, fp4.NVFP4),
        "w_nk": w_nk,
        "w_kn": jnp.swapaxes(w_nk, 1, 2),
        "packed": jax.jit(pack_weights, static_argnums=1)(w, fp4.NVFP4),
        "sizes": jnp.bincount(groups, length=g).astype(jnp.int32),
    }


@jax.jit
def _float32_product(a, w_nk, sizes):
    """The float32 grouped product of float32 operands at HIGHEST precision (the tiled form:
    no dense expansion over the experts, so it fits at prefill sizes)."""
    with jax.default_matmul_precision("highest"):
        w_kn = jnp.swapaxes(w_nk, 1, 2)
        return tiled_ragged_dot(a, w_kn, sizes, preferred_element_type=jnp.float32)


def references(ops: dict) -> dict:
    """kernel name -> the float32 product of that kernel's operands."""
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    bf16 = _float32_product(f32(ops["x"]), f32(ops["w_nk"]), ops["sizes"])
    w_fp4 = dequantize_weights(ops["packed"])
    by_fp4_act = {
        "fp4_bf16_act": _float32_product(f32(ops["x"]), w_fp4, ops["sizes"]),
        "fp4_nvfp4_act": _float32_product(dequantize_lhs(ops["xq"]), w_fp4, ops["sizes"]),
    }
    by_fp4_act |= {f"{name}_predecoded": ref for name, ref in by_fp4_act.items()}
    return {"ragged_dot": bf16, "tiled": bf16, "pallas_bf16": bf16, **by_fp4_act}


def kernel_call(name: str, ops: dict, tiling: dict | None = None):
    """(fn, args) of one kernel (a Pallas kernel with `tiling`'s keywords), bf16 out."""
    tiling = tiling or {}
    if name == "ragged_dot":
        return jax.lax.ragged_dot, (ops["x"], ops["w_kn"], ops["sizes"])
    if name == "tiled":
        return tiled_ragged_dot, (ops["x"], ops["w_kn"], ops["sizes"])
    if name == DENSE:
        return jnp.matmul, (ops["x"], ops["w_kn"][0])
    if name == "pallas_bf16":
        fn = functools.partial(grouped_matmul, implementation="pallas", **tiling)
        return fn, (ops["x"], ops["w_nk"], ops["sizes"])
    predecode = name in PREDECODED
    fn = functools.partial(fp4_moe_matmul, implementation="pallas", predecode=predecode, **tiling)
    lhs = ops["x"] if name.startswith("fp4_bf16_act") else ops["xq"]
    return fn, (lhs, ops["packed"], ops["sizes"])


def bytes_moved(name: str, ops: dict) -> int:
    """Bytes a kernel must move at least: the weights of the experts that have rows, the
    activations, and the bf16 output."""
    m, _ = ops["x"].shape
    g, n, _ = ops["w_nk"].shape
    out = m * n * 2
    if name == DENSE:
        return harness.nbytes(ops["x"], ops["w_kn"][0]) + out
    active = int(jnp.count_nonzero(ops["sizes"]))
    weights = ops["packed"] if name.startswith("fp4") else ops["w_nk"]
    lhs = ops["xq"] if name.startswith("fp4_nvfp4_act") else ops["x"]
    return harness.nbytes(weights) * active // g + harness.nbytes(lhs) + out


def relative_error(out: jax.Array, ref: jax.Array) -> float:
    out = out.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def sweep(name: str, ops: dict, ref: jax.Array, configs, *, smoke: bool):
    """One entry per block config: its median ms and error, or the error that stopped it; and the
    (fn, args) of each entry (the same function objects hit jit's cache when timed again)."""
    entries, calls = [], []
    for tiling in configs:
        tiling = dict(tiling)
        fn, args = kernel_call(name, ops, tiling)
        calls.append((fn, args))
        try:
            err = relative_error(jax.jit(fn)(*args), ref)
            seconds = timing.time_fn(fn, *args, inner=10, trials=3, warmup=2, smoke=smoke)
            entries.append({"config": tiling, "ms": 1e3 * seconds, "rel_err": err})
        # Any failure of one config (tiles that do not fit the shapes, Triton out of shared memory
        # or registers, a compile error) is a result of the sweep, not the end of it.
        except Exception as e:
            entries.append({"config": tiling, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        logging.info("%s %s: %s", name, tiling, entries[-1])
    return entries, calls


def measure_phase(config: ConfigDict, phase: str, m: int, read_bw: float):
    """(rows, sweeps) of one phase: a row per kernel and the dense matmul; the sweep entries."""
    ops = operands(config, m)
    refs = references(ops)
    calls, sweeps, best = {}, {}, {}
    for name in SWEPT:
        configs = config.block_configs[phase][name]
        sweeps[name], sweep_calls = sweep(name, ops, refs[name], configs, smoke=config.smoke)
        timed = [i for i, e in enumerate(sweeps[name]) if "ms" in e]
        best[name] = None
        if timed:
            i = min(timed, key=lambda i: sweeps[name][i]["ms"])
            best[name], calls[name] = sweeps[name][i], sweep_calls[i]
    calls |= {name: kernel_call(name, ops) for name in ("ragged_dot", "tiled", DENSE)}
    smoke = config.smoke
    trials = dict(inner=1, trials=1, warmup=1) if smoke else dict(inner=10, trials=3, warmup=2)
    by_round = timing.time_interleaved(calls, rounds=config.rounds, **trials)
    ms = {name: 1e3 * statistics.median(t) for name, t in by_round.items()}
    loop_ms = {}
    if config.loop_seconds:  # the same calls without the host's dispatch per call
        per_call_s = {name: 1e-3 * t for name, t in ms.items()}
        loop_s = timing.device_loop_times(
            calls, ops["x"], loop_seconds=config.loop_seconds, unroll=config.loop_unroll,
            per_call_s=per_call_s, carry_arg=LOOP_CARRY_ARG, smoke=config.smoke,
        )  # fmt: skip
        loop_ms = {name: 1e3 * t for name, t in loop_s.items()}
    flops = 2 * m * config.d_model * config.d_ff
    dense_tflops = flops / ms[DENSE] / 1e9
    rows = []
    for name in (*KERNELS, DENSE):
        row = {"phase": phase, "M": m, "G": config.experts, "K": config.d_model}
        row |= {"N": config.d_ff, "kernel": name}
        row["active_experts"] = int(jnp.count_nonzero(ops["sizes"]))
        row["routing_skew"] = config.get("routing_skew", 0.0)
        row["max_over_mean_rows"] = float(jnp.max(ops["sizes"])) * config.experts / m
        if name in SWEPT:
            row["block_config"] = best[name]["config"] if best[name] else None
        if name not in ms:
            row["error"] = "every block config failed (see the sweep)"
            rows.append(row)
            continue
        row["ms"] = ms[name]
        row["ms_by_round"] = [1e3 * t for t in by_round[name]]
        row["tflops"] = flops / ms[name] / 1e9
        row["frac_of_dense"] = row["tflops"] / dense_tflops
        row["bytes_GB"] = bytes_moved(name, ops) / 1e9
        row["byte_limit_ms"] = 1e3 * row["bytes_GB"] * 1e9 / read_bw
        row["byte_limit_ratio"] = ms[name] / row["byte_limit_ms"]
        row["vs_ragged_dot"] = ms["ragged_dot"] / ms[name]
        if loop_ms:
            row["loop_ms"] = loop_ms[name]
            row["loop_byte_limit_ratio"] = loop_ms[name] / row["byte_limit_ms"]
            row["loop_floor_ms"] = loop_ms[timing.LOOP_FLOOR]
        if name in SWEPT:
            row["rel_err"] = best[name]["rel_err"]
        elif name != DENSE:
            fn, args = calls[name]
            row["rel_err"] = relative_error(jax.jit(fn)(*args), refs[name])
        rows.append(row)
        logging.info("%s", row)
    return rows, sweeps


def measure_decode_pass(config: ConfigDict, copy_bw: float) -> list[dict]:
    """Rows of the weights' decode pass (phase `weights_decode`): the XLA fusion and, where the
    Pallas kernels lower through Triton (interpreted on a CPU), the Pallas pass, to each 16-bit
    dtype, timed in alternating rounds; `byte_limit_ms` at the copy bandwidth."""
    packed = jax.jit(pack_weights, static_argnums=1)(weights(config), fp4.NVFP4)
    target = common.pallas_target()
    calls = {}
    for dtype in (jnp.float16, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        xla = functools.partial(predecoded.decoded_weights, dtype=jnp.dtype(dtype))
        calls[f"decode_xla_{name}"] = (xla, (packed,))
        if target.lowering is common.Lowering.TRITON:
            pallas = functools.partial(
                predecoded.decode_weights, dtype=dtype, interpret=target.interpret
            )
            calls[f"decode_pallas_{name}"] = (pallas, (packed,))
    smoke = config.smoke
    trials = dict(inner=1, trials=1, warmup=1) if smoke else dict(inner=10, trials=3, warmup=2)
    by_round = timing.time_interleaved(calls, rounds=config.rounds, **trials)
    g, n, k = packed.shape
    n_bytes = harness.nbytes(packed.codes, packed.scales) + 2 * g * n * k
    rows = []
    for name, (fn, args) in calls.items():
        ms = 1e3 * statistics.median(by_round[name])
        row = {"phase": "weights_decode", "G": g, "K": k, "N": n, "kernel": name, "ms": ms}
        row["ms_by_round"] = [1e3 * t for t in by_round[name]]
        row["bytes_GB"] = n_bytes / 1e9
        row["byte_limit_ms"] = 1e3 * n_bytes / copy_bw
        row["byte_limit_ratio"] = ms / row["byte_limit_ms"]
        xla_fn, xla_args = calls[name.replace("pallas", "xla")]
        same = jnp.array_equal(
            jax.lax.bitcast_convert_type(jax.jit(fn)(*args), jnp.uint16),
            jax.lax.bitcast_convert_type(jax.jit(xla_fn)(*xla_args), jnp.uint16),
        )
        row["bit_exact_vs_xla"] = bool(same)
        rows.append(row)
        logging.info("%s", row)
    return rows


def bench(config: ConfigDict) -> tuple[list[dict], dict]:
    """Rows of every phase of `config.phases` and of the weights' decode pass, and the extra
    JSON (ceilings, sweeps)."""
    ceilings = harness.ceilings(config.ceiling_bytes, smoke=config.smoke)
    rows, sweeps = [], {}
    for phase, m in config.phases:
        phase_rows, sweeps[phase] = measure_phase(config, phase, m, ceilings["read_bw"])
        rows += phase_rows
    rows += measure_decode_pass(config, ceilings["copy_bw"])
    summary = {
        phase: {r["kernel"]: r.get("ms") for r in rows if r["phase"] == phase}
        for phase in (*(phase for phase, _ in config.phases), "weights_decode")
    }
    return rows, {"ceilings": ceilings, "summary_ms": summary, "sweep": sweeps}


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Measures every phase and writes `<outdir>/<name>.{json,md}`; returns the rows."""
    rows, extra = bench(config)
    notes = (
        "`ms`: median over alternating rounds; `tflops`: 2 M K N / time; `frac_of_dense`: of "
        "the dense bf16 `[M, K] x [K, N]` rate in the same run; `byte_limit_ms`: weights of "
        "the experts with rows + activations + bf16 output, over the measured read bandwidth "
        f"({extra['ceilings']['read_bw'] / 1e12:.2f} TB/s); `vs_ragged_dot`: ragged_dot's time "
        "over this one; `rel_err`: Frobenius norm against the float32 product of the same "
        "operands; `loop_ms`: per call inside one device loop of calls chained back to back (no "
        "host dispatch per call; includes the loop's own cost per call, `loop_floor_ms` in the "
        "JSON rows); `block_config`: the best of the Pallas kernel's sweep (every entry in the "
        "JSON's `sweep`, `{}` = the kernel's default_block_config). Phase `weights_decode`: "
        "the predecoded kernels' decode pass alone (XLA fusion, Pallas pass), `byte_limit_ms` "
        "there at the copy bandwidth "
        f"({extra['ceilings']['copy_bw'] / 1e12:.2f} TB/s; codes and scales read, 2 bytes a "
        "value written), `bit_exact_vs_xla` in the JSON rows."
        + (harness.SMOKE_NOTE if config.smoke else "")
    )
    table = harness.write_table(
        name,
        rows,
        COLUMNS,
        title="Grouped expert matmul: bf16 and FP4 kernels",
        notes=notes,
        outdir=outdir,
        extra=extra,
    )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="bench_moe_matmul", name="kernels_moe_matmul")
