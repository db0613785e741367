r"""Where the FP4 decode-attention kernel's time goes: the kernel cut down stage by stage.

Nsight Compute does not run under JAX on the device machine (it segfaulted), so the split comes
from timing cut-down kernels side by side instead. Every variant is the production kernel's launch
(`kernel.flash_decode`: grid, BlockSpecs, masked loads, the default FP4 tiling) over the same
packed NVFP4 cache, with a different body:

  load    reads every K/V byte (codes, scale bits, global scales) and XORs / adds it into
          register accumulators (about 0.5 op per element), nothing else;
  decode  + the word-level PTX decode to float16 planes and the block scales (`load_kv`, as in
          production), accumulated with one float16 add per element;
  scores  + q . k on the tensor cores (with the register-to-dot-operand layout conversion of K),
          the row factors and the running max; V still only decoded and accumulated;
  softmax + the online softmax (rescale, exp, sums, V's row factors on p); p summed, not used;
  full    the production kernel (+ p . v, with V's layout conversion to a dot operand).

Then `load` and `full` again over a slot-major copy of the cache ([B, S, Hkv, ...], made before
timing; the cache's own layout is head-major, [B, Hkv, S, ...], one program's rows contiguous:
this pair says what that layout gains), the same body and launch otherwise; and `full` with p . v
in the other order than the production launch's (`BlockConfig.pv_transposed`, acc^T += V^T . p^T,
the default from head_dim 128: the paper-like shape's other row is `p.v untransposed`).
Differences between consecutive rows of the default order are what each part adds
(approximately: the accumulation that keeps a stage's loads alive costs a little of its own).
Beside them: the bf16 twin over the bf16 cache and the read ceiling of the same run. Shape and
contexts: configs/decode_attention_ablation.py (the paper-like shape: batch 16, 32 query heads,
4 KV heads, head_dim 128). Writes `<outdir>/<name>.{md,json}` (default
`decode_attention_ablation`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental import pallas as pl
from ml_collections import ConfigDict

from experiments import harness, timing
from kernels_pallas.fp4_decode_attention import api
from kernels_pallas.fp4_decode_attention import kernel as K
from trace_jax import fp4

STAGES = ("load", "decode", "scores", "softmax", "full")
# Stages timed again over a slot-major copy of the cache (`slot_major`). (Kv heads innermost in
# the grid, another slot-major remedy, is not timed: its loads ran 10-17% and the kernel 1-3%
# slower than over the head-major cache in every H200 run.)
SLOT_MAJOR_STAGES = ("load", "full")
COLUMNS = ["shape", "context", "variant", "ms", "added_ms", "bandwidth_fraction_of_read"]


def api_plan(q, k_cache, v_cache, lengths) -> api.DecodePlan:
    """The plan (tiling, interpret mode) of the production FP4 kernel's default launch."""
    return api.fp4_decode_attention_plan(q, k_cache, v_cache, lengths, implementation="pallas")


def api_fp4(q, k_cache, v_cache, lengths) -> jax.Array:
    """The production FP4 kernel through its api (Pallas, default launch)."""
    return api.fp4_decode_attention(q, k_cache, v_cache, lengths, implementation="pallas")


def api_bf16_twin(q, k, v, lengths) -> jax.Array:
    """The bf16 Pallas twin over the bf16 cache."""
    return api.bf16_decode_attention(q, k, v, lengths, implementation="pallas")


def slot_major(cache):
    """A packed cache's head-major arrays [B, Hkv, S, ...] copied to [B, S, Hkv, ...] (a real
    copy, in the layout the kernel read before the cache became head-major)."""
    return jax.tree.map(lambda a: jnp.swapaxes(a, 1, 2), cache)


def _loop(len_ref, q_scale_ref, refs, n_planes, n_kv_refs, chunk, block_s, step, init, finish):
    """The production kernel's split loop around `step(i, start, valid, qs, q_scale, carry)`;
    `finish(carry)` -> m [block_g] float32, written with zero accumulators and unit sums."""
    q_refs, kv_refs = refs[:n_planes], refs[n_planes : n_planes + n_kv_refs]
    acc_refs, (m_ref, sum_ref) = refs[n_planes + n_kv_refs : -2], refs[-2:]
    length = len_ref[()]
    chunk_start = pl.program_id(2) * chunk
    n_blocks = jnp.clip(pl.cdiv(length - chunk_start, block_s), 0, chunk // block_s)
    qs = [r[...] for r in q_refs]
    q_scale = q_scale_ref[...][:, None]

    def body(i, carry):
        start = chunk_start + i * block_s
        valid = start + jnp.arange(block_s, dtype=jnp.int32) < length
        return step(kv_refs, start, valid, qs, q_scale, carry)

    carry = jax.lax.fori_loop(0, n_blocks, body, init(kv_refs, qs))
    m = finish(carry)
    for acc_ref, q in zip(acc_refs, qs, strict=True):
        acc_ref[...] = jnp.zeros(q.shape, jnp.float32)
    m_ref[...] = m
    sum_ref[...] = jnp.ones_like(m)


def _reduce(arrays, block_g: int) -> jax.Array:
    """All accumulators summed into one float32, broadcast to [block_g] (keeps them alive)."""
    total = jnp.zeros((), jnp.float32)
    for a in arrays:
        a = a.astype(jnp.float32)
        while a.ndim > 1:  # one axis at a time (what the Triton lowering reduces)
            a = a.sum(axis=-1)
        total = total + a.sum(axis=0)
    return jnp.full((block_g,), total, jnp.float32)


def _stage_body(parts: Callable) -> Callable:
    """A kernel body with the production body's signature from `parts(block_s, block_g, dp,
    n_planes, load_kv)` -> (init(kv_refs, qs), step(kv_refs, start, valid, qs, q_scale, carry),
    finish(carry) -> m [block_g])."""

    def body(
        len_ref,
        q_scale_ref,
        *refs,
        load_kv,
        n_planes,
        n_kv_refs,
        block_s,
        chunk,
        v_factor,
    ):
        del v_factor
        block_g, dp = refs[0].shape
        init, step, finish = parts(block_s, block_g, dp, n_planes, load_kv)
        _loop(
            len_ref,
            q_scale_ref,
            refs,
            n_planes,
            n_kv_refs,
            chunk,
            block_s,
            step,
            init,
            finish,
        )

    return body


def _load_parts(block_s, block_g, dp, n_planes, load_kv):
    def init(kv_refs, qs):
        return tuple(jnp.zeros((block_s, *r.shape[1:]), r.dtype) for r in kv_refs)

    def step(kv_refs, start, valid, qs, q_scale, accs):
        rows = [K.load_rows(r, start, block_s, valid) for r in kv_refs]
        return tuple(
            a ^ x if jnp.issubdtype(x.dtype, jnp.integer) else a + x
            for a, x in zip(accs, rows, strict=True)
        )

    return init, step, lambda accs: _reduce(accs, block_g)


def _decode_parts(block_s, block_g, dp, n_planes, load_kv):
    def init(kv_refs, qs):
        planes = tuple(jnp.zeros((block_s, dp), qs[0].dtype) for _ in range(2 * n_planes))
        return planes, jnp.zeros((block_s,), jnp.float32)

    def step(kv_refs, start, valid, qs, q_scale, carry):
        planes, rows = carry
        ks, k_scale, vs, v_scale = load_kv(kv_refs, start, valid)
        planes = tuple(a + x for a, x in zip(planes, (*ks, *vs), strict=True))
        for f in (k_scale, v_scale):
            rows = rows if f is None else rows + f
        return planes, rows

    return init, step, lambda c: _reduce((*c[0], c[1]), block_g)


def _scores_parts(block_s, block_g, dp, n_planes, load_kv):
    def init(kv_refs, qs):
        v_planes = tuple(jnp.zeros((block_s, dp), qs[0].dtype) for _ in range(n_planes))
        return jnp.full((block_g,), -jnp.inf, jnp.float32), v_planes, jnp.zeros((block_s,))

    def step(kv_refs, start, valid, qs, q_scale, carry):
        m, v_planes, rows = carry
        ks, k_scale, vs, v_scale = load_kv(kv_refs, start, valid)
        s = K.block_scores(qs, ks, k_scale, valid, q_scale)
        v_planes = tuple(a + x for a, x in zip(v_planes, vs, strict=True))
        rows = rows if v_scale is None else rows + v_scale
        return jnp.maximum(m, s.max(axis=1)), v_planes, rows

    # V's accumulators times 0 keep V's decode alive without changing m.
    return init, step, lambda c: c[0] + _reduce((*c[1], c[2]), block_g) * 0.0


def _softmax_parts(block_s, block_g, dp, n_planes, load_kv):
    """`scores` plus the production body's online softmax (running max, rescale, exp, sums and
    the probabilities scaled by V's row factors); p is summed instead of multiplied into V."""

    def init(kv_refs, qs):
        v_planes = tuple(jnp.zeros((block_s, dp), qs[0].dtype) for _ in range(n_planes))
        m = jnp.full((block_g,), -jnp.inf, jnp.float32)
        return m, jnp.zeros((block_g,), jnp.float32), jnp.zeros((block_g,), jnp.float32), v_planes

    def step(kv_refs, start, valid, qs, q_scale, carry):
        m, total, p_sum, v_planes = carry
        ks, k_scale, vs, v_scale = load_kv(kv_refs, start, valid)
        s = K.block_scores(qs, ks, k_scale, valid, q_scale)
        m_new, alpha, p, total = K.online_softmax_step(m, total, s)
        p, pv_scale = K.weight_by_v_rows(p, v_scale, vs[0].dtype)
        p_sum = alpha * p_sum + pv_scale * p.astype(jnp.float32).sum(axis=1)
        v_planes = tuple(a + x for a, x in zip(v_planes, vs, strict=True))
        return m_new, total, p_sum, v_planes

    def finish(c):
        m, total, p_sum, v_planes = c
        return m + (total + p_sum + _reduce(v_planes, block_g)) * 0.0

    return init, step, finish


BODIES = {
    "load": _stage_body(_load_parts),
    "decode": _stage_body(_decode_parts),
    "scores": _stage_body(_scores_parts),
    "softmax": _stage_body(_softmax_parts),
    "full": None,  # the production body
}


@functools.partial(jax.jit, static_argnames=("stage", "config", "interpret", "slot_major"))
def run_stage(
    q, k_cache, v_cache, lengths, *, stage: str, config, interpret: bool, slot_major: bool = False
) -> jax.Array:
    """The FP4 kernel's launch over the packed caches with `stage`'s body -> [B, H, Dh] (only
    "full" is attention; the others return what keeps their work alive). `slot_major`: the
    caches come from `slot_major(...)`."""
    inputs = K.fp4_kernel_inputs(q.dtype, k_cache, v_cache, config, interpret)
    return K.flash_decode(
        q,
        lengths=lengths,
        config=config,
        interpret=interpret,
        name=f"fp4_decode_attn_{stage}",
        body=BODIES[stage],
        **{**inputs, "head_major": not slot_major},
    )


def bench(config: ConfigDict) -> tuple[list[dict], dict]:
    """Every variant at each context of `config.contexts` -> (rows, the run's ceilings)."""
    b, h, hkv, dh = config.batch, config.heads, config.kv_heads, config.head_dim
    smoke = config.smoke
    ceil = harness.ceilings(config.ceiling_bytes, smoke=smoke)
    rows = []
    for ctx in config.contexts:
        k, v = harness.random_kv(b, ctx, hkv, dh, seed=ctx)
        q = jax.random.normal(jax.random.key(5), (b, h, dh), jnp.bfloat16)
        lengths = jnp.full((b,), ctx, jnp.int32)
        kc, vc = harness.packed_kv_cache(k, fp4.NVFP4), harness.packed_kv_cache(v, fp4.NVFP4)
        plan = api_plan(q, kc, vc, lengths)
        fp4_bytes = harness.nbytes(kc, vc)
        run = functools.partial(run_stage, config=plan.config, interpret=plan.interpret)
        # The "full" stage is the production kernel: the same numbers as the api.
        want = api_fp4(q, kc, vc, lengths)
        got = run(q, kc, vc, lengths, stage="full")
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        if err:
            raise AssertionError(f"ablation 'full' differs from the api kernel by {err}")
        base = {"shape": f"B{b} H{h} Hkv{hkv} Dh{dh} nvfp4", "context": ctx}

        other_pv = functools.partial(
            run_stage,
            config=dataclasses.replace(plan.config, pv_transposed=not plan.config.pv_transposed),
            interpret=plan.interpret,
        )
        by_slots = functools.partial(run, slot_major=True)
        caches, slots = (kc, vc), (slot_major(kc), slot_major(vc))
        # (row name, stage, launch, caches, chained to the row above, tolerance of a `full`
        # output against the api kernel's, relative to its largest |value|).
        variants = [(f"fp4 {s}", s, run, caches, True, 0.0) for s in STAGES]
        variants += [(f"fp4 {s}, slot-major cache", s, by_slots, slots, False, 0.0)
                     for s in SLOT_MAJOR_STAGES]  # fmt: skip
        # The same products summed in another order: equal to the output's rounding.
        other_order = "untransposed" if plan.config.pv_transposed else "transposed"
        variants += [(f"fp4 full, p.v {other_order}", "full", other_pv, caches, False, 2.0**-6)]
        scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
        prev = None
        for name, stage, fn, (kx, vx), chained, tol in variants:
            try:
                if stage == "full":  # every full variant computes the api's attention
                    got = fn(q, kx, vx, lengths, stage="full").astype(jnp.float32)
                    err = float(jnp.max(jnp.abs(got - want.astype(jnp.float32))))
                    if err > tol * scale:
                        raise AssertionError(f"{name} differs from the api kernel by {err}")
                timed = functools.partial(fn, stage=stage)
                t = timing.time_fn(timed, q, kx, vx, lengths, smoke=smoke)
            except Exception as e:  # a body Triton cannot lower must not lose the other rows
                logging.exception("%s failed", name)
                rows.append({**base, "variant": name, "error": repr(e)[:300]})
                prev = None
                continue
            rows.append(
                {
                    **base,
                    "variant": name,
                    "ms": 1e3 * t,
                    **({"added_ms": 1e3 * (t - prev)} if chained and prev else {}),
                    "bandwidth_fraction_of_read": fp4_bytes / t / ceil["read_bw"],
                }
            )
            prev = t if chained else None
            logging.info("%s", rows[-1])
        t = timing.time_fn(api_bf16_twin, q, k, v, lengths, smoke=smoke)
        bf16_bytes = harness.nbytes(k, v)
        rows.append(
            {
                **base,
                "variant": "bf16 twin (full)",
                "ms": 1e3 * t,
                "bandwidth_fraction_of_read": bf16_bytes / t / ceil["read_bw"],
            }
        )
        rows.append(
            {
                **base,
                "variant": "read ceiling, FP4 bytes",
                "ms": 1e3 * fp4_bytes / ceil["read_bw"],
                "bandwidth_fraction_of_read": 1.0,
            }
        )
    return rows, ceil


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Times every variant and writes `<outdir>/<name>.{md,json}`; returns the rows."""
    rows, ceil = bench(config)
    cols = COLUMNS + (["error"] if any("error" in r for r in rows) else [])
    table = harness.write_table(
        name,
        rows,
        cols,
        title="FP4 decode attention, cut down stage by stage",
        notes=(
            "Each fp4 row is the production launch with the kernel body cut after that stage "
            "(module docstring of `experiments/decode_attention_ablation.py`); `added_ms`: over "
            f"the row above. Read ceiling {ceil['read_bw'] / 1e9:.0f} GB/s, measured in this run."
            + (harness.SMOKE_NOTE if config.smoke else "")
        ),
        outdir=outdir,
    )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="decode_attention_ablation", name="decode_attention_ablation")
