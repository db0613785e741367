r"""FP4 kernels against their bf16 / XLA counterparts, side by side in one run.

Measures (median seconds per call after warm-up, see experiments/timing.py):
  * ceilings: device copy bandwidth (read + write) and read bandwidth (`jnp.sum` over uint8);
  * fused quantize + compact capture (Pallas) vs the XLA reference vs a copy of the same input;
  * FP4 decode attention (Pallas) vs the fastest bf16 variant: XLA einsum-softmax-einsum,
    `jax.experimental.pallas.ops.gpu.decode_attention.gqa` (k_splits tuned) and our bf16 twin;
  * FP4 MoE grouped matmul (Pallas) vs bf16 `jax.lax.ragged_dot` at decode and prefill sizes;
  * one decode step of the `small` preset, bf16 vs FP4 W/A/KV (XLA and Pallas kernel backends),
    with guidance capture off, compact and full.
Writes experiments/results/kernels.{md,json} (`--outdir`, `--name`).

  python -m experiments.bench_kernels                 # on the H200 (full sizes)
  python -m experiments.bench_kernels --quick         # smoke run on a CPU (tiny sizes, interpret)
"""

from __future__ import annotations

import functools
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from jax.experimental import pallas as pl

from experiments import harness
from experiments.harness import nbytes, paired_ratio, time_fn, time_interleaved
from kernels_pallas.fp4_decode_attention import api as attn
from kernels_pallas.fp4_moe_matmul import api as moe
from kernels_pallas.fp4_moe_matmul.reference import pack_weights
from kernels_pallas.fp4_quantize import fp4_quantize
from trace_jax import fp4
from trace_jax.models import (
    KVCache,
    LayerKVCache,
    ModelConfig,
    decode_step,
    init_model,
    pack_model_experts,
)
from trace_jax.models.packed_kv_cache import PackedLayerKVCache, PackedTensorCache
from trace_jax.quant import QuantConfig, QuantSites, SiteMode
from trace_jax.rollout.sampler import pack_rows


def _time(quick: bool, fn, *args, **kw) -> float:
    """`time_fn`; in quick mode (CPU smoke run: interpret-mode kernels, meaningless numbers) one
    warm-up and one timed call."""
    if quick:
        kw.update(inner=1, trials=1, warmup=1)
    return time_fn(fn, *args, **kw)


def _key(i):
    return jax.random.key(i)


def ceilings(quick: bool) -> dict[str, float]:
    n = 1 << (20 if quick else 30)  # 1 GiB of bytes on the GPU
    u8 = jax.random.randint(_key(0), (n,), 0, 255, jnp.int32).astype(jnp.uint8)
    # Two reductions over the same bytes; the faster is the read ceiling (the uint8 sum alone was
    # beaten by our bf16 attention kernel in the first H200 run, so it is not a ceiling).
    t_read = min(
        _time(quick, lambda a: jnp.sum(a, dtype=jnp.int32), u8),
        _time(
            quick, lambda a: jnp.sum(jax.lax.bitcast_convert_type(a, jnp.uint32)), u8.reshape(-1, 4)
        ),
    )
    x = jax.random.normal(_key(1), (n // 2,), jnp.bfloat16)
    t_copy = _time(quick, lambda a: a + jnp.asarray(1, a.dtype), x)
    return {"read_bw": n / t_read, "copy_bw": 2 * nbytes(x) / t_copy}


# (block_r, block_n, num_warps) launches of the quantize kernel timed side by side; the first is
# the default (whole rows). Expected (kernels_findings.md item 10): more warps per 4096-wide row
# spread the per-block work (NVFP4 has 256 blocks of 16 per row) and may lift NVFP4 from 8% of
# copy bandwidth toward MXFP4's 31%; column tiles give 2-D tiles and 8-16x more programs (NVFP4
# then reads each row once more for its global scale, inside the timed call). The last four
# (session 10): larger row-loop programs, NVFP4 with its global scale inside the kernel.
# Alternating timing rounds per decode-step context (`harness.time_interleaved`).
STEP_ROUNDS = 7
# (rows per program, column tile or None, warps, row-loop chunk or None), see `fp4_quantize`.
QUANTIZE_LAUNCHES = (
    (None, None, 4, None),
    (1, None, 2, None),
    (1, None, 8, None),
    (2, None, 8, None),
    (4, None, 8, None),
    (8, 512, 4, None),
    (4, 1024, 4, None),
    (16, 256, 4, None),
    (4, None, 4, 1024),
    (8, None, 4, 512),
    (8, None, 8, 1024),
    (2, None, 4, 2048),
    (1, None, 4, 2048),
    (2, None, 8, 2048),
)


def mark_fastest(rows: list[dict]) -> list[dict]:
    """`rows` (timed launches of one op, `ms` each) with `fastest` True on the quickest only."""
    best = min(range(len(rows)), key=lambda i: rows[i]["ms"])
    return [{**r, "fastest": i == best} for i, r in enumerate(rows)]


def bench_quantize(quick: bool, copy_bw: float) -> list[dict]:
    """Quantize + capture, Pallas (each launch of `QUANTIZE_LAUNCHES`, `launch`
    "b<block_r>[x<block_n>] w<warps>"; `fastest` marks the one the summary reports) and XLA, vs a
    copy of the same input."""
    rows, n = (256, 256) if quick else (65536, 4096)
    x = jax.random.normal(_key(2), (rows, n), jnp.bfloat16)
    t_copy = _time(quick, lambda a: a + jnp.asarray(1, a.dtype), x)
    launches = (
        (QUANTIZE_LAUNCHES[0], (2, 64, 4, None), (2, None, 4, 64)) if quick else QUANTIZE_LAUNCHES
    )
    out = []
    for fmt in (fp4.NVFP4, fp4.MXFP4):
        ref = jax.jit(lambda a, f=fmt: fp4_quantize(a, f, backend="xla"))(x)
        moved = nbytes(x) + nbytes(ref)

        def row(backend, t, launch="n/a", f=fmt, moved=moved):
            return {
                "op": "quantize+capture",
                "format": f.name,
                "backend": backend,
                "launch": launch,
                "shape": f"{rows}x{n} bf16",
                "ms": 1e3 * t,
                "copy_ms": 1e3 * t_copy,
                "bandwidth_fraction_of_copy": moved / t / copy_bw,
            }

        sweep = []
        for block_r, block_n, warps, loop_n in launches:
            if (block_n or loop_n or 0) >= n:
                continue
            kw = dict(block_r=block_r, block_n=block_n, num_warps=warps, loop_n=loop_n)
            kw["backend"] = "pallas"
            got = jax.jit(lambda a, f=fmt, kw=kw: fp4_quantize(a, f, **kw))(x)
            for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
            t = _time(quick, lambda a, f=fmt, kw=kw: fp4_quantize(a, f, **kw), x)
            tile = f"b{block_r or 'default'}" + (f"x{block_n}" if block_n else "")
            tile += f" loop{loop_n}" if loop_n else ""
            sweep.append(row("pallas", t, f"{tile} w{warps}"))
        out += mark_fastest(sweep)
        out.append(row("xla", _time(quick, lambda a, f=fmt: fp4_quantize(a, f, backend="xla"), x)))
        logging.info("%s", out[-len(sweep) - 1 :])
    return out


def _kv(b, s, hkv, dh, seed):
    k = jax.random.normal(_key(seed), (b, s, hkv, dh), jnp.bfloat16)
    v = jax.random.normal(_key(seed + 1), (b, s, hkv, dh), jnp.bfloat16)
    return k, v


def _packed(x, fmt):
    b, s = x.shape[:2]
    slots = jnp.broadcast_to(jnp.arange(s), (b, s))
    return PackedTensorCache.empty(x.shape, fmt).write(x, slots)


def _xla_attention(q, k, v, lengths):
    b, h, dh = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, h // hkv, dh)
    s = jnp.einsum("bngd,bsnd->bngs", qg, k, preferred_element_type=jnp.float32) * dh**-0.5
    mask = jnp.arange(k.shape[1])[None, None, None, :] < lengths[:, None, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("bngs,bsnd->bngd", p, v).reshape(b, h, dh)


def bench_decode_attention(quick: bool, read_bw: float, contexts) -> list[dict]:
    shapes = [("paper-like", 16, 32, 4, 128), ("small preset", 16, 8, 2, 64)]
    if quick:
        shapes, contexts = [("quick", 2, 4, 2, 64)], [256]
    out = []
    for label, b, h, hkv, dh in shapes:
        for ctx in contexts:
            k, v = _kv(b, ctx, hkv, dh, seed=ctx)
            q = jax.random.normal(_key(5), (b, h, dh), jnp.bfloat16)
            lengths = jnp.full((b,), ctx, jnp.int32)
            fmt = fp4.NVFP4
            kc, vc = _packed(k, fmt), _packed(v, fmt)
            ref = attn.fp4_decode_attention(q, kc, vc, lengths, backend="xla")
            ref_norm = jnp.linalg.norm(ref.astype(jnp.float32))
            # Decode variants x tile sizes side by side, each checked on the device; the fastest
            # is reported (all are in fp4_ms_by_variant, errors in fp4_rel_err_by_variant).
            fp4_by_variant, err_by_variant = {}, {}
            # (decode, block_s, num_warps, k_splits, num_stages[, pv_transposed]); None: the
            # api's default. The first is the default launch; "e4m3" is the previous decode at
            # the previous launch (block_s 64, 2 programs per SM).
            two_per_sm = attn.default_k_splits(b, hkv, ctx, 64)
            variants = [("f16", None, 4, None, None), ("e4m3", 64, 4, two_per_sm, 2)]
            # At every context: longer steps and deeper load pipelining (kernels_findings
            # item 19: 256-slot steps were the fastest at 128K, paper-like shape).
            variants += [("f16", 256, 4, None, 2), ("f16", 128, 4, None, 2)]
            # The other p . v order than the default's (kernels_findings item 22).
            other_pv = dh < attn.FP4_PV_TRANSPOSED_MIN_HEAD_DIM
            variants += [
                (*launch, other_pv)
                for launch in (("f16", None, 4, None, None), ("f16", 256, 4, None, 2))
            ]
            if ctx in (32768, 131072) and (label == "paper-like" or ctx == 131072):
                # Launch tuning where the goals are set (the first H200 sweep chose the default).
                variants += [
                    ("f16", bs, warps, splits, stages)
                    for bs in (64, 128)
                    for warps, splits, stages in ((4, two_per_sm, 2), (4, None, 3), (8, None, 2))
                ] + [("f16", 64, 4, None, 2)]
                variants += [("f16", 256, 8, None, 2), ("f16", 128, 4, None, 4)]
                variants += [("f16", 256, 4, None, 3)]
            variants = [v if len(v) == 6 else (*v, None) for v in variants]
            variants = list(dict.fromkeys(variants))  # each launch timed once
            for decode, bs, warps, splits, stages, pv_t in variants[:1] if quick else variants:
                run_fp4 = functools.partial(
                    attn.fp4_decode_attention,
                    backend="pallas",
                    block_s=bs,
                    decode=decode,
                    num_warps=warps,
                    k_splits=splits,
                    num_stages=stages,
                    pv_transposed=pv_t,
                )
                got = run_fp4(q, kc, vc, lengths)
                plan = attn.fp4_decode_attention_plan(
                    q, kc, vc, lengths, block_s=bs, k_splits=splits, num_stages=stages,
                    pv_transposed=pv_t, backend="pallas",
                )  # fmt: skip
                key = (
                    f"{decode}/bs={plan.config.block_s}/warps={warps}/splits={plan.k_splits}"
                    f"/stages={plan.config.num_stages}"
                    + ("/pvT" if plan.config.pv_transposed else "")
                )
                err_by_variant[key] = float(
                    jnp.linalg.norm((got - ref).astype(jnp.float32)) / ref_norm
                )
                fp4_by_variant[key] = _time(
                    quick, lambda q, kc, vc, n, f=run_fp4: f(q, kc, vc, n), q, kc, vc, lengths
                )
                logging.info(
                    "attention %s @%d %s: %.3f ms, rel err %.1e",
                    label,
                    ctx,
                    key,
                    1e3 * fp4_by_variant[key],
                    err_by_variant[key],
                )
            best_variant = min(fp4_by_variant, key=fp4_by_variant.get)
            t_fp4 = fp4_by_variant[best_variant]
            err = err_by_variant[best_variant]
            twin = attn.bf16_decode_attention(q, k, v, lengths, backend="pallas")
            ref_bf16 = _xla_attention(q, k, v, lengths).astype(jnp.float32)
            twin_err = float(
                jnp.linalg.norm(twin.astype(jnp.float32) - ref_bf16) / jnp.linalg.norm(ref_bf16)
            )
            bf16 = {
                "xla einsum": _time(quick, _xla_attention, q, k, v, lengths),
                "bf16 twin": _time(
                    quick,
                    lambda q, k, v, n: attn.bf16_decode_attention(q, k, v, n, backend="pallas"),
                    q,
                    k,
                    v,
                    lengths,
                ),
            }
            if not quick:
                from jax.experimental.pallas.ops.gpu import decode_attention as jax_da

                for ks in (16, 64):
                    bf16[f"jax gqa k_splits={ks}"] = _time(
                        quick,
                        lambda q, k, v, n, ks=ks: jax_da.gqa(q, k, v, kv_seq_len=n, k_splits=ks),
                        q,
                        k,
                        v,
                        lengths,
                    )
            best = min(bf16, key=bf16.get)
            fp4_bytes = nbytes(q, kc, vc)
            out.append(
                {
                    "op": "decode attention",
                    "shape": label,
                    "context": ctx,
                    "fp4_ms": 1e3 * t_fp4,
                    "fp4_variant": best_variant,
                    "fp4_ms_by_variant": {k2: 1e3 * t for k2, t in fp4_by_variant.items()},
                    "fp4_rel_err_by_variant": err_by_variant,
                    "bf16_twin_rel_err_vs_xla": twin_err,
                    "best_bf16": best,
                    "best_bf16_ms": 1e3 * bf16[best],
                    "bf16_ms": {k2: 1e3 * t for k2, t in bf16.items()},
                    "speedup_vs_best_bf16": bf16[best] / t_fp4,
                    "fp4_bandwidth_fraction": fp4_bytes / t_fp4 / read_bw,
                    "bf16_best_bandwidth_fraction": nbytes(q, k, v) / bf16[best] / read_bw,
                    "fp4_rel_err_vs_reference": err,
                }
            )
            logging.info("%s", out[-1])
    return out


def bench_moe(quick: bool) -> list[dict]:
    g, d, f, topk = (4, 64, 64, 2) if quick else (128, 2048, 768, 8)
    counts = {"decode": 16 * topk, "prefill": (64 if quick else 4096) * topk}
    w = jax.random.normal(_key(7), (g, f, d), jnp.float32) * 0.02  # [G, N, K]: gate/up proj
    packed = pack_weights(w, fp4.NVFP4)
    w_bf16 = jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16)  # [G, K, N] for ragged_dot
    out = []
    for label, m in counts.items():
        x = jax.random.normal(_key(8), (m, d), jnp.bfloat16)
        sizes = jnp.bincount(jax.random.randint(_key(9), (m,), 0, g), length=g).astype(jnp.int32)
        xq = fp4.quantize(x, fp4.NVFP4)
        ref = moe.fp4_moe_matmul(xq, packed, sizes, backend="xla", out_dtype=jnp.float32)
        t_bf16 = _time(quick, lambda x, w, s: jax.lax.ragged_dot(x, w, s), x, w_bf16, sizes)
        # Both Pallas program orders, each checked against the reference on the device.
        variants = {
            "row_tiles": {},
            # Row tiles near the mean group size (at least 16, Triton's dot minimum).
            "groups": {"block_m": int(max(16, min(64, pl.next_power_of_2(max(1, m // g)))))},
        }
        by_grid, errs = {}, {}
        for grid, extra in variants.items():
            run_fp4 = functools.partial(moe.fp4_moe_matmul, backend="pallas", grid=grid, **extra)
            got = run_fp4(xq, packed, sizes, out_dtype=jnp.float32)
            errs[grid] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            by_grid[grid] = _time(quick, lambda a, p, s, f=run_fp4: f(a, p, s), xq, packed, sizes)
        best = min(by_grid, key=by_grid.get)
        t_fp4 = by_grid[best]
        out.append(
            {
                "op": "moe grouped matmul",
                "fp4_bytes_GB": nbytes(xq, packed) / 1e9,
                "phase": label,
                "M": m,
                "G": g,
                "K": d,
                "N": f,
                "fp4_ms": 1e3 * t_fp4,
                "fp4_grid": best,
                "fp4_ms_by_grid": {k2: 1e3 * t for k2, t in by_grid.items()},
                "bf16_ragged_dot_ms": 1e3 * t_bf16,
                "speedup": t_bf16 / t_fp4,
                "fp4_rel_err_vs_reference": max(errs.values()),
            }
        )
        logging.info("%s", out[-1])
    return out


class Laps:
    """Wall seconds between successive calls: `lap(part)` records the time since the previous
    call (or since construction) in `seconds[part]`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part], self._last = now - self._last, now


def _filled_cache(cfg, b, ctx, kv_format, kernel_backend, seed, extra=1):
    """A cache holding `ctx` random tokens per sequence (as if prefilled) and `extra` free slots,
    bf16 or packed FP4."""
    layers = []
    for i in range(cfg.n_layers):
        k, v = _kv(b, ctx + extra, cfg.n_kv_heads, cfg.head_dim, seed=seed + 2 * i)
        if kv_format is None:
            layers.append(LayerKVCache(k=k, v=v))
        else:
            fmt = fp4.get_format(kv_format)
            slots = jnp.broadcast_to(jnp.arange(ctx + extra), (b, ctx + extra))
            layers.append(
                PackedLayerKVCache(
                    k=PackedTensorCache.empty(k.shape, fmt, kernel_backend).write(k, slots),
                    v=PackedTensorCache.empty(v.shape, fmt, kernel_backend).write(v, slots),
                )
            )
    return KVCache(layers=tuple(layers), lengths=jnp.full((b,), ctx, jnp.int32))


def bench_decode_step(quick: bool, contexts, backends=("xla", "pallas")) -> list[dict]:
    """One `small`-preset decode step: bf16 vs FP4 W/A/KV; capture off / compact / full.

    Times `n_steps` steps in one jitted loop and reports the time per step: every variant of a
    context is compiled first, then all are timed in `STEP_ROUNDS` alternating rounds; a row has
    each variant's median over rounds (`<variant>_ms`), speedups and capture overheads as medians
    of same-round ratios, and every round's times (`ms_by_round`). `backends`: the FP4 kernel
    backends timed ("pallas" is required: capture is timed on it). Each FP4 variant took 8-13 s
    of wall time on the H200, mostly compilation, since parameters are arguments.
    """
    if "pallas" not in backends or not set(backends) <= {"xla", "pallas"}:
        raise ValueError(f"backends must include 'pallas' and be among xla, pallas: {backends}")
    # quick: a CPU smoke run, two decoder blocks to keep its compiles short
    cfg = ModelConfig.tiny(head_dim=32, n_layers=2) if quick else ModelConfig.small()
    b = 2 if quick else 16
    n_steps = 2 if quick else 8
    contexts = [64] if quick else contexts
    qcfg = QuantConfig.nvfp4()
    # Parameters are arguments of the timed step, never constants baked into it: as constants,
    # XLA constant-folded the weight quantization (minutes of compile per variant on the H200).
    graphdef, params = nnx.split(init_model(cfg))
    # The Pallas rollout packs FP4 expert weights once per policy version (sampler.generate);
    # packing is outside the timed step, as there.
    packed = jax.jit(lambda p: pack_model_experts(nnx.merge(graphdef, p), qcfg))(params)
    keys = qcfg.guided_keys(cfg.n_layers)
    tokens = jnp.ones((b,), jnp.int32)
    out = []
    for ctx in contexts:

        def one_step(params, packed, cache, tok, mode, capture, kb, full):
            sites = QuantSites(
                qcfg,
                cfg.n_layers,
                mode,
                capture=keys if capture else (),
                differentiable=False,
                kernel_backend=kb,
                packed_experts=packed if kb == "pallas" else None,
            )
            logits, aux, cache = decode_step(nnx.merge(graphdef, params), cache, tok, site=sites)
            g = sites.captured_guidance("full" if full else "compact")
            # A step's records as the sampler keeps them: experts and guidance in one byte row.
            row = pack_rows([jnp.moveaxis(aux["topk_idx"], 1, 0), *jax.tree.leaves(g)])
            return logits, row, cache

        def step(params, packed, cache, tok, mode, capture, kb, full):
            # `n_steps` decode steps in one jitted loop, as the sampler runs them (one call per
            # step would time the dispatch of its outputs at short contexts); every step's records
            # go to a step-indexed buffer, as in the sampler. Returns the last logits.
            args = (params, packed, cache, tok, mode, capture, kb, full)
            row = jax.eval_shape(lambda: one_step(*args)[1])
            rows = jnp.zeros((n_steps, *row.shape), row.dtype)

            def body(i, carry):
                cache, tok, rows, _ = carry
                logits, row, cache = one_step(params, packed, cache, tok, mode, capture, kb, full)
                rows = jax.lax.dynamic_update_index_in_dim(rows, row, i, 0)
                return cache, jnp.argmax(logits, -1).astype(jnp.int32), rows, logits

            init = (cache, tok, rows, jnp.zeros((b, cfg.vocab_size), jnp.float32))
            _, _, rows, logits = jax.lax.fori_loop(0, n_steps, body, init)
            return logits, rows

        # Wall seconds of each part (filling, compiling with warm-up, timing): what a GPU
        # command's time goes to.
        lap = Laps()
        caches = {"bf16": _filled_cache(cfg, b, ctx, None, "xla", seed=11, extra=n_steps)}
        lap("fill bf16")
        calls = {
            "bf16": (
                lambda p, c, t: step(p, None, c, t, SiteMode.OFF, False, "xla", False),
                (params, caches["bf16"], tokens),
            )
        }
        for kb in backends:
            caches[kb] = _filled_cache(cfg, b, ctx, "nvfp4", kb, seed=11, extra=n_steps)
            lap(f"fill {kb}")
            variants = [("no capture", False, False), ("compact", True, False)]
            variants += [("full", True, True)]
            for label, capture, full in variants if kb == "pallas" else variants[:1]:
                calls[f"fp4_{kb}_{label}"] = (
                    lambda p, w, c, tk, kb=kb, cap=capture, f=full: step(
                        p, w, c, tk, SiteMode.RTN, cap, kb, f
                    ),
                    (params, packed, caches[kb], tokens),
                )

        def ready(name, ctx=ctx, lap=lap):
            lap(f"compile {name}")
            logging.info("decode step @%d: %s compiled and warm", ctx, name)

        # All variants in alternating rounds: the overheads compare variants a few percent
        # apart, so drift between them must not decide the sign (item 8, kernels_findings).
        rounds = 1 if quick else STEP_ROUNDS
        kw = dict(inner=1, trials=1, warmup=1) if quick else dict(inner=2, trials=3)
        per_round = time_interleaved(calls, rounds=rounds, on_ready=ready, **kw)
        lap("timing")
        ms = {k: [1e3 * t / n_steps for t in v] for k, v in per_round.items()}

        row = {
            "op": "decode step",
            "preset": "tiny" if quick else "small",
            "context": ctx,
            "batch": b,
            "steps_per_call": n_steps,
            "rounds": rounds,
        }
        for name, values in ms.items():
            row[f"{name}_ms"] = statistics.median(values)
        for kb in backends:
            row[f"fp4_{kb}_speedup_vs_bf16"] = paired_ratio(ms, "bf16", f"fp4_{kb}_no capture")
        for label in ("compact", "full"):
            base = "fp4_pallas_no capture"
            row[f"fp4_pallas_{label}_overhead"] = paired_ratio(ms, f"fp4_pallas_{label}", base) - 1
        row["ms_by_round"] = ms
        row["wall_s_by_part"] = lap.seconds
        out.append(row)
        logging.info("%s", row)
    return out


def _write(rows, ceil, errors, quick, outdir, name, previous):
    """Summary + markdown tables of the sections run so far, written to <outdir>/<name>.*."""
    q_rows, a_rows, m_rows, s_rows = (
        rows.get(k, []) for k in ("quantize", "decode_attention", "moe", "decode_step")
    )
    dev = jax.devices()[0]
    summary = {
        "device": getattr(dev, "device_kind", str(dev)),
        "read_bw_GBps": ceil["read_bw"] / 1e9,
        "copy_bw_GBps": ceil["copy_bw"] / 1e9,
        "quantize_bandwidth_fraction": {
            r["format"]: r["bandwidth_fraction_of_copy"]
            for r in q_rows
            if r["backend"] == "pallas" and r.get("fastest", True)  # earlier JSONs: one row
        },
        "decode_attention_bandwidth_fraction": {
            f"{r['shape']}@{r['context']}": r["fp4_bandwidth_fraction"] for r in a_rows
        },
        "speedup_vs_best_bf16_at_32k_plus": {
            f"{r['shape']}@{r['context']}": r["speedup_vs_best_bf16"]
            for r in a_rows
            if r["context"] >= 32768
        },
        "decode_step_speedup": {str(r["context"]): r["fp4_pallas_speedup_vs_bf16"] for r in s_rows},
        "errors": errors,
        "guidance_capture_overhead": {
            str(r["context"]): {
                "compact": r["fp4_pallas_compact_overhead"],
                "full": r["fp4_pallas_full_overhead"],
            }
            for r in s_rows
        },
    }
    tables = "\n\n".join(
        [
            harness.markdown_table(
                q_rows,
                [
                    "op",
                    "format",
                    "backend",
                    "launch",
                    "shape",
                    "ms",
                    "copy_ms",
                    "bandwidth_fraction_of_copy",
                ],
            ),
            harness.markdown_table(
                a_rows,
                [
                    "shape",
                    "context",
                    "fp4_ms",
                    "fp4_variant",
                    "best_bf16",
                    "best_bf16_ms",
                    "speedup_vs_best_bf16",
                    "fp4_bandwidth_fraction",
                    "fp4_rel_err_vs_reference",
                    "bf16_twin_rel_err_vs_xla",
                ],
            ),
            harness.markdown_table(
                m_rows,
                [
                    "phase",
                    "M",
                    "G",
                    "K",
                    "N",
                    "fp4_ms",
                    "fp4_grid",
                    "bf16_ragged_dot_ms",
                    "speedup",
                    "fp4_rel_err_vs_reference",
                ],
            ),
            harness.markdown_table(
                s_rows,
                [
                    "preset",
                    "context",
                    "batch",
                    "bf16_ms",
                    "fp4_xla_no capture_ms",
                    "fp4_pallas_no capture_ms",
                    "fp4_pallas_compact_ms",
                    "fp4_pallas_full_ms",
                    "fp4_pallas_speedup_vs_bf16",
                    "fp4_pallas_compact_overhead",
                    "fp4_pallas_full_overhead",
                ],
            ),
        ]
    )
    notes = (
        f"Ceilings measured in this run: read {summary['read_bw_GBps']:.0f} GB/s, copy "
        f"{summary['copy_bw_GBps']:.0f} GB/s."
        + (
            " QUICK smoke run: sizes are tiny and "
            "Pallas runs in interpret mode; the numbers mean nothing."
            if quick
            else ""
        )
    )
    kept: dict[tuple[str, str], list[str]] = {}
    for r in q_rows + a_rows + m_rows + s_rows:
        if r in previous.get("rows", []):
            where = " ".join(str(r[k]) for k in MERGE_KEYS.get(r["section"], ()))
            kept.setdefault((r["section"], r.get("measured_by", "?")), []).append(where)
    for (section, measured_by), where in sorted(kept.items()):
        which = "" if not any(where) else f" (rows {', '.join(dict.fromkeys(where))})"
        notes += (
            f" Section {section}{which} is kept from an earlier run, {measured_by}; its "
            "fractions use that run's ceilings."
        )
    harness.write_results(
        name,
        q_rows + a_rows + m_rows + s_rows,
        title="FP4 kernels",
        table=tables,
        notes=notes,
        outdir=outdir,
        extra={"summary": summary},
    )
    return summary, tables, notes


SECTIONS = ("quantize", "decode_attention", "moe", "decode_step")
# With `keep_from`, rows of these sections are merged by these keys: a run over some contexts
# replaces those rows and keeps the earlier run's other contexts (the decode step at five
# contexts does not fit one GPU command). Other sections run are replaced whole.
MERGE_KEYS = {"decode_attention": ("shape", "context"), "decode_step": ("context",)}


def merge_rows(section: str, earlier: list[dict], new: list[dict]) -> list[dict]:
    """`new` rows plus the `earlier` rows of `section` whose MERGE_KEYS differ from every new
    row's, sorted by those keys (only `new` for sections without merge keys)."""
    keys = MERGE_KEYS.get(section)
    if not keys:
        return new

    def key(r):
        return tuple(r[k] for k in keys)

    replaced = {key(r) for r in new}
    kept = [r for r in earlier if r.get("section") == section and key(r) not in replaced]
    return sorted(kept + new, key=key)


def define_flags() -> None:
    """Command-line flags (defined only when run as a script)."""
    flags.DEFINE_bool("quick", False, "tiny sizes, CPU smoke run (numbers meaningless)")
    flags.DEFINE_list("contexts", ["4096", "8192", "32768", "65536", "131072"], "")
    flags.DEFINE_string("outdir", harness.RESULTS_DIR, "where results are written")
    flags.DEFINE_string("name", "kernels", "result file stem")
    flags.DEFINE_list("sections", list(SECTIONS), "benchmarks to run")
    flags.DEFINE_list(
        "step_contexts",
        ["4096", "8192", "32768", "65536", "131072"],
        "contexts of the decode-step benchmark (the attention sweep's)",
    )
    flags.DEFINE_list("step_backends", ["xla", "pallas"], "FP4 backends of the decode step")
    flags.DEFINE_string("keep_from", "", "earlier results JSON: keep its rows of sections not run")


def run(
    *,
    quick: bool = False,
    contexts: list[str] = ("4096", "8192", "32768", "65536", "131072"),
    outdir: str = harness.RESULTS_DIR,
    name: str = "kernels",
    sections: tuple[str, ...] = SECTIONS,
    step_contexts: list[str] = ("4096", "8192", "32768", "65536", "131072"),
    step_backends: list[str] = ("xla", "pallas"),
    keep_from: str = "",
) -> dict:
    """Runs every benchmark and writes the results; returns the summary.

    `keep_from`: an earlier results JSON of this script whose rows of the sections not run now are
    kept, and of the sections run, the rows at other contexts (`MERGE_KEYS`), so sections too
    long for one GPU command can run in separate commands; the notes name each kept row's
    command and date.
    """
    contexts = [int(c) for c in contexts]
    previous = {}
    if keep_from:
        with open(keep_from) as f:
            previous = json.load(f)
    ceil = ceilings(quick)
    logging.info("ceilings %s", ceil)
    errors: dict[str, str] = {}

    def maybe(section, fn, *args):
        # One failing kernel (e.g. a Triton lowering error) must not lose the other measurements;
        # failures are recorded in the results and make the script exit non-zero.
        if section not in sections:
            return [r for r in previous.get("rows", []) if r.get("section") == section]
        try:
            meta = harness.provenance()
            measured = f"`{meta['command']}` ({meta['date']})"
            new = [{"section": section, "measured_by": measured, **r} for r in fn(*args)]
            return merge_rows(section, previous.get("rows", []), new)
        except Exception:
            errors[section] = traceback.format_exc()
            logging.error("section %s failed:\n%s", section, errors[section])
            return []

    benches = {
        "quantize": (bench_quantize, (quick, ceil["copy_bw"])),
        "decode_attention": (bench_decode_attention, (quick, ceil["read_bw"], contexts)),
        "moe": (bench_moe, (quick,)),
        "decode_step": (
            bench_decode_step,
            (quick, [int(c) for c in step_contexts], tuple(step_backends)),
        ),
    }
    unknown = set(sections) - set(benches)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {list(benches)}")
    rows = {
        section: maybe(section, fn, *args)
        for section, (fn, args) in benches.items()
        if section not in sections
    }  # kept from `keep_from`, if given
    for section in sections:  # in the order given: the first ones finish if time runs out
        fn, args = benches[section]
        rows[section] = maybe(section, fn, *args)
        # Written after every section: a command stopped by its time limit keeps what finished.
        summary, tables, notes = _write(rows, ceil, errors, quick, outdir, name, previous)
    print(tables)
    print(notes)
    if errors:
        raise RuntimeError(f"benchmark sections failed: {sorted(errors)} (tracebacks in the JSON)")
    return summary


def main(argv):
    del argv
    f = flags.FLAGS
    run(
        quick=f.quick,
        contexts=f.contexts,
        outdir=f.outdir,
        name=f.name,
        sections=f.sections,
        step_contexts=f.step_contexts,
        step_backends=f.step_backends,
        keep_from=f.keep_from,
    )


if __name__ == "__main__":
    define_flags()
    app.run(main)
