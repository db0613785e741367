"""Per-layer routing imbalance of the rollout benchmark's random-init Qwen3-30B-A3B-shaped model
during prefill of one prompt, on the CPU (the benchmark itself reports it on the GPU:
`trace_jax.rollout.variants.routing_balance`). The model is built as experiments/profile_rollout.py
and rollout_throughput.py build it (`ModelSpec(preset="qwen3_5_35b_a3b", n_layers=12,
grouped_matmul="auto")`, bf16 parameters, `init_model(seed=0)`), but one block at a time from the
same `nnx.Rngs` stream (the same bits, a fraction of the memory), its attention norms set as
`rollout_policy(init=INIT)` sets them (`trace_jax.rollout.variants.MODEL_INITS`; default
"selective_attention", "normal" for the collapsing plain init); each block runs as `forward_cached`
runs it (a KV cache of P + 256 slots, grouped MoE) and its router's top-k is counted. Per layer it
also records the share of the MoE input's energy in the direction common to the prompt's tokens
(`moe_in_common`: |mean_t h_t|^2 / mean_t |h_t|^2; 0 for unrelated tokens, 1 for identical ones)
and the same for the attention's output (`attn_common`).

usage: PYTHONPATH=. python scripts/routing_balance_cpu.py PROMPT_LEN [N_LAYERS] [N_PROMPTS] [INIT]
  (2048-token prompt, 12 layers: about 4 minutes and 6 GB on two cores; writes
  /tmp/routing_balance/stats_P<len>_nb<n>[_<INIT>].json, no suffix for "normal")
"""

import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.models.attention import CacheMask, LayerKVCache, causal_mask
from trace_jax.models.config import identity_site
from trace_jax.models.moe import MoEImpl
from trace_jax.models.qwen3_moe import DecoderLayer
from trace_jax.rl.model_spec import ModelSpec
from trace_jax.rollout.variants import MODEL_INITS, rollout_inputs, sharpen_attention

INIT = sys.argv[4] if len(sys.argv) > 4 else "selective_attention"
if (
    len(sys.argv) < 2
    or not all(a.isdigit() and int(a) > 0 for a in sys.argv[1:4])
    or INIT not in MODEL_INITS
):
    sys.exit(
        f"usage: {sys.argv[0]} PROMPT_LEN [N_LAYERS] [N_PROMPTS] (positive integers) "
        f"[INIT] (one of {MODEL_INITS})"
    )
P = int(sys.argv[1])
L = int(sys.argv[2]) if len(sys.argv) > 2 else 12
NB = int(sys.argv[3]) if len(sys.argv) > 3 else 1  # prompts run together (rows of one chunk)
NEW = 256
OUT = "/tmp/routing_balance"


def build_cfg(n_layers=12):
    cfg = ModelSpec(preset="qwen3_5_35b_a3b", n_layers=n_layers, grouped_matmul="auto").build()
    return dataclasses.replace(cfg, param_dtype=jnp.bfloat16)  # as rollout_policy


def stats(topk, E=128):
    c = np.bincount(np.asarray(topk).reshape(-1), minlength=E).astype(np.float64)
    mean = c.mean()
    s = np.sort(c)[::-1]
    return dict(
        rows=int(c.sum()),
        max_over_mean=float(s[0] / mean),
        zero=int((c == 0).sum()),
        top5_share=[float(x / c.sum()) for x in s[:5]],
        cv=float(c.std() / mean),
        min=int(s[-1]),
    )


def common_share(a):
    """Mean over prompts of |mean_t a_t|^2 / mean_t |a_t|^2 for `a [B, T, D]`."""
    a = a.astype(jnp.float32)
    shared = jnp.sum(jnp.square(jnp.mean(a, axis=1)), axis=-1)
    return float(jnp.mean(shared / jnp.mean(jnp.sum(a * a, axis=-1), axis=1)))


if __name__ == "__main__":
    cfg = build_cfg(12)
    print(cfg, flush=True)
    # prompts as rollout_inputs draws them for the benchmark's batch of 64; row(s) 0..NB-1
    prompts = rollout_inputs(cfg, None, 64, P)[1][:NB]
    rngs = nnx.Rngs(0)
    init = nnx.initializers.normal(cfg.init_std)
    embed = init(rngs.params(), (cfg.vocab_size, cfg.d_model), cfg.param_dtype)  # Qwen3MoE order
    x = jnp.take(embed, prompts, axis=0).astype(cfg.dtype)
    del embed
    S = P + NEW
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (NB, P))
    lengths = jnp.full((NB,), P, jnp.int32)

    @functools.partial(jax.jit, static_argnames=("graphdef", "layer"))
    def run_block(graphdef, state, x, positions, lengths, layer):
        block = nnx.merge(graphdef, state)
        attn_out, _ = block.attn(  # what the block's attention adds (recomputed, for its stats)
            block.attn_norm(x),
            positions=positions,
            mask=causal_mask(positions < lengths[:, None]),
            layer=layer,
            site=identity_site,
        )
        moe_in = block.mlp_norm(x + attn_out)
        shape = (x.shape[0], S, cfg.n_kv_heads, cfg.head_dim)
        cache = LayerKVCache(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype))
        mask = CacheMask(positions, lengths, S, from_start=True)
        x, routing, _, _ = block(
            x,
            layer=layer,
            positions=positions,
            mask=mask,
            valid=positions < lengths[:, None],
            site=identity_site,
            expert_choices=None,
            cache=cache,
            slots=positions,
            moe_impl=MoEImpl.GROUPED,
        )
        top1 = jnp.max(routing.probs, axis=-1)
        assert routing.probs.dtype == jnp.float32
        return x, routing.topk_idx, jnp.mean(top1), attn_out, moe_in

    os.makedirs(OUT, exist_ok=True)
    out = dict(prompt_len=P, n_prompts=NB, init=INIT, layers=[])
    rng = np.random.default_rng(0)
    ctrl = np.argsort(rng.random((NB * P, cfg.n_experts)), axis=1)[:, : cfg.top_k]
    out["uniform_control"] = stats(ctrl)
    print("uniform control", out["uniform_control"], flush=True)
    for i in range(L):
        t0 = time.time()
        block = DecoderLayer(cfg, rngs=rngs)
        if INIT == "selective_attention":
            sharpen_attention([block])
        graphdef, state = nnx.split(block)
        del block
        x, topk, mtop1, attn_out, moe_in = run_block(
            graphdef, state, x, positions, lengths, layer=i
        )
        topk = np.asarray(topk)
        st = stats(topk)
        st["layer"] = i
        st["mean_top1_prob"] = float(mtop1)
        st["attn_common"], st["moe_in_common"] = common_share(attn_out), common_share(moe_in)
        st["x_rms"] = float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))
        st["sec"] = time.time() - t0
        out["layers"].append(st)
        print(st, flush=True)
        del state
        suffix = "" if INIT == "normal" else f"_{INIT}"
        json.dump(out, open(f"{OUT}/stats_P{P}_nb{NB}{suffix}.json", "w"), indent=1)
