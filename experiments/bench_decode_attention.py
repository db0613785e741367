r"""FP4 decode attention (Pallas) over the packed FP4 KV cache against the fastest bf16 one.

Per (shape, context): the FP4 kernel at each launch of the sweep (decode variant, slots per step,
warps, k_splits, load stages, p . v order), each checked against the XLA reference on the device;
the fastest is reported (every launch's time and error are kept in the row). Against it the bf16
variants over the bf16 cache: XLA einsum-softmax-einsum, our bf16 Pallas twin and, on a GPU,
`jax.experimental.pallas.ops.gpu.decode_attention.gqa` at a few k_splits; the fastest of these is
the baseline. Bandwidth fractions: bytes read (q and the cache) over the time, against the read
bandwidth of the same run (`harness.ceilings`). Writes `<outdir>/<name>.{json,md}` (default
`kernels_decode_attention`). Launch commands: configs/bench_decode_attention.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from absl import logging
from ml_collections import ConfigDict

from experiments import harness, timing
from kernels_pallas.fp4_decode_attention import api as attn
from trace_jax import fp4

COLUMNS = ["shape", "context", "fp4_ms", "fp4_variant", "best_bf16", "best_bf16_ms"]
COLUMNS += ["speedup_vs_best_bf16", "fp4_bandwidth_fraction", "fp4_rel_err_vs_reference"]
COLUMNS += ["bf16_twin_rel_err_vs_xla"]


def fp4_attention(q, k_cache, v_cache, lengths, implementation: str, **launch) -> jax.Array:
    """`fp4_decode_attention` by `implementation` ("xla" | "pallas") with `launch`'s keywords."""
    return attn.fp4_decode_attention(
        q, k_cache, v_cache, lengths, implementation=implementation, **launch
    )


def fp4_plan(q, k_cache, v_cache, lengths, **launch) -> attn.DecodePlan:
    """The plan the Pallas FP4 kernel runs with `launch`'s keywords (its effective tiling)."""
    return attn.fp4_decode_attention_plan(
        q, k_cache, v_cache, lengths, implementation="pallas", **launch
    )


def bf16_twin(q, k, v, lengths) -> jax.Array:
    """Our bf16 Pallas decode attention over the bf16 cache."""
    return attn.bf16_decode_attention(q, k, v, lengths, implementation="pallas")


def xla_attention(q, k, v, lengths) -> jax.Array:
    """Plain XLA decode attention: q [B, H, Dh], k / v [B, S, Hkv, Dh], lengths [B] -> [B, H, Dh]
    (einsum, masked softmax in float32, einsum)."""
    b, h, dh = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, h // hkv, dh)
    s = jnp.einsum("bngd,bsnd->bngs", qg, k, preferred_element_type=jnp.float32) * dh**-0.5
    mask = jnp.arange(k.shape[1])[None, None, None, :] < lengths[:, None, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("bngs,bsnd->bngd", p, v).reshape(b, h, dh)


def launches(batch: int, kv_heads: int, head_dim: int, context: int, tuned: bool) -> list[tuple]:
    """The FP4 launches timed at one point, each once: (decode, block_s, num_warps, k_splits,
    num_stages, pv_transposed), None for the api's default. The first is the default launch;
    "e4m3" is the other decode at 64-slot steps, 2 programs per SM."""
    two_per_sm = attn.default_k_splits(batch, kv_heads, context, 64)
    out = [("f16", None, 4, None, None), ("e4m3", 64, 4, two_per_sm, 2)]
    # Longer steps and deeper load pipelining (256-slot steps were the fastest at 128K on the
    # paper-like shape in an earlier sweep).
    out += [("f16", 256, 4, None, 2), ("f16", 128, 4, None, 2)]
    # p . v in the other order than the default's.
    other_pv = head_dim < attn.FP4_PV_TRANSPOSED_MIN_HEAD_DIM
    out += [(*v, other_pv) for v in (("f16", None, 4, None, None), ("f16", 256, 4, None, 2))]
    if tuned:
        out += [
            ("f16", bs, warps, splits, stages)
            for bs in (64, 128)
            for warps, splits, stages in ((4, two_per_sm, 2), (4, None, 3), (8, None, 2))
        ]
        out += [("f16", 64, 4, None, 2), ("f16", 256, 8, None, 2), ("f16", 128, 4, None, 4)]
        out += [("f16", 256, 4, None, 3)]
    return list(dict.fromkeys(v if len(v) == 6 else (*v, None) for v in out))


def rel_err(got: jax.Array, want: jax.Array) -> float:
    want = want.astype(jnp.float32)
    return float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))


def bench_point(config: ConfigDict, shape: tuple, context: int, read_bw: float) -> dict:
    """One row: every FP4 launch and every bf16 variant at one (shape, context)."""
    label, b, h, hkv, dh = shape
    smoke = config.smoke
    k, v = harness.random_kv(b, context, hkv, dh, seed=context)
    q = jax.random.normal(jax.random.key(5), (b, h, dh), jnp.bfloat16)
    lengths = jnp.full((b,), context, jnp.int32)
    fmt = fp4.get_format(config.format)
    kc, vc = harness.packed_kv_cache(k, fmt), harness.packed_kv_cache(v, fmt)
    ref = fp4_attention(q, kc, vc, lengths, "xla")
    fp4_ms, errs = {}, {}
    points = launches(b, hkv, dh, context, (label, context) in config.tuned)
    for decode, bs, warps, splits, stages, pv_t in points if config.launch_sweep else points[:1]:
        launch = dict(
            decode=decode,
            block_s=bs,
            num_warps=warps,
            k_splits=splits,
            num_stages=stages,
            pv_transposed=pv_t,
        )
        run = functools.partial(fp4_attention, implementation="pallas", **launch)
        plan = fp4_plan(q, kc, vc, lengths, **launch)
        key = (
            f"{decode}/bs={plan.config.block_s}/warps={warps}/splits={plan.k_splits}"
            f"/stages={plan.config.num_stages}" + ("/pvT" if plan.config.pv_transposed else "")
        )
        errs[key] = rel_err(run(q, kc, vc, lengths), ref)
        fp4_ms[key] = 1e3 * timing.time_fn(run, q, kc, vc, lengths, smoke=smoke)
        logging.info(
            "attention %s @%d %s: %.3f ms, rel err %.1e",
            label,
            context,
            key,
            fp4_ms[key],
            errs[key],
        )
    best_variant = min(fp4_ms, key=fp4_ms.get)
    bf16_ms = {
        "xla einsum": 1e3 * timing.time_fn(xla_attention, q, k, v, lengths, smoke=smoke),
        "bf16 twin": 1e3 * timing.time_fn(bf16_twin, q, k, v, lengths, smoke=smoke),
    }
    if config.jax_gqa_k_splits:
        from jax.experimental.pallas.ops.gpu import decode_attention as jax_da  # GPU only

        for ks in config.jax_gqa_k_splits:
            gqa = functools.partial(jax_da.gqa, k_splits=ks)
            bf16_ms[f"jax gqa k_splits={ks}"] = 1e3 * timing.time_fn(
                lambda q, k, v, n, f=gqa: f(q, k, v, kv_seq_len=n), q, k, v, lengths, smoke=smoke
            )
    best = min(bf16_ms, key=bf16_ms.get)
    twin_err = rel_err(bf16_twin(q, k, v, lengths), xla_attention(q, k, v, lengths))
    t_fp4 = fp4_ms[best_variant] / 1e3
    return {
        "op": "decode attention",
        "shape": label,
        "context": context,
        "fp4_ms": fp4_ms[best_variant],
        "fp4_variant": best_variant,
        "fp4_ms_by_variant": fp4_ms,
        "fp4_rel_err_by_variant": errs,
        "bf16_twin_rel_err_vs_xla": twin_err,
        "best_bf16": best,
        "best_bf16_ms": bf16_ms[best],
        "bf16_ms": bf16_ms,
        "speedup_vs_best_bf16": bf16_ms[best] / fp4_ms[best_variant],
        "fp4_bandwidth_fraction": harness.nbytes(q, kc, vc) / t_fp4 / read_bw,
        "bf16_best_bandwidth_fraction": harness.nbytes(q, k, v) / (bf16_ms[best] / 1e3) / read_bw,
        "fp4_rel_err_vs_reference": errs[best_variant],
    }


def summarize(rows: list[dict], ceil: dict[str, float]) -> dict:
    """The run's ceilings (GB/s), the FP4 kernel's fraction of read bandwidth per point, and its
    speedup over the best bf16 variant from 32K slots on."""
    point = lambda r: f"{r['shape']}@{r['context']}"
    return {
        "read_bw_GBps": ceil["read_bw"] / 1e9,
        "copy_bw_GBps": ceil["copy_bw"] / 1e9,
        "bandwidth_fraction": {point(r): r["fp4_bandwidth_fraction"] for r in rows},
        "speedup_vs_best_bf16_at_32k_plus": {
            point(r): r["speedup_vs_best_bf16"] for r in rows if r["context"] >= 32768
        },
    }


def notes(summary: dict, smoke: bool) -> str:
    return (
        "`fp4_variant`: the fastest FP4 launch (decode/slots per step/warps/k_splits/load "
        "stages, pvT: p . v transposed); every launch's time is in the JSON. Bandwidth "
        f"fractions against the read bandwidth of the same run ({summary['read_bw_GBps']:.0f} "
        "GB/s)." + (harness.SMOKE_NOTE if smoke else "")
    )


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Measures every (shape, context) point and writes `<outdir>/<name>.{json,md}` after each
    (a command stopped by its time limit keeps the points it finished); returns the rows."""
    ceil = harness.ceilings(config.ceiling_bytes, smoke=config.smoke)
    logging.info("ceilings %s", ceil)
    rows = []
    for shape in config.shapes:
        for context in config.contexts:
            rows.append(bench_point(config, tuple(shape), context, ceil["read_bw"]))
            logging.info("%s", rows[-1])
            summary = summarize(rows, ceil)
            table = harness.write_table(
                name,
                rows,
                COLUMNS,
                title="FP4 decode attention",
                notes=notes(summary, config.smoke),
                outdir=outdir,
                extra={"summary": summary},
            )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="bench_decode_attention", name="kernels_decode_attention")
