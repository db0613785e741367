"""Rollout variants at a model's shapes, for measuring rollouts: bf16, FP4 W/A/KV on the kernels,
FP4 with TRACE's compact or full guidance capture, FP4 by XLA fake quantization; each variant's
`generate` arguments, its compiled rollout, and the bytes one decode step must read.

| name            | rollout                                                          |
| --------------- | ---------------------------------------------------------------- |
| `bf16`          | no quantization; experts by the model's `grouped_matmul`         |
| `fp4`           | NVFP4 (or the given format) W/A/KV on the Pallas kernels          |
| `fp4 + compact` | `fp4`, recording TRACE's compact guidance at its guided sites    |
| `fp4 + full`    | `fp4`, recording full codes at every FP4 site (TRACE-full)       |
| `fp4 xla`       | W/A/KV by XLA fake quantization (the reference path)             |
| `bf16 + flash prefill`, `fp4 + flash prefill` | `bf16`, `fp4` with the prefill chunks'      |
|                 | attention by the flash kernel (`prefill_attention="auto"`)        |
| `bf16 + cudnn prefill`, `fp4 + cudnn prefill` | the same by cuDNN's fused attention         |
|                 | for chunks of whole prompts (`prefill_attention="cudnn"`)         |
| `fp4 + in-kernel decode`, `fp4 + cudnn prefill + in-kernel decode` | `fp4`, `fp4 + cudnn   |
|                 | prefill` with the prefill chunks' FP4 expert weights decoded in   |
|                 | the kernel (`ModelConfig.predecode_experts=False`), not before    |
|                 | each grouped matmul as the op's default does for them             |

Every rollout samples at temperature 1 with no stop token, so that each sequence decodes all its
new tokens; one compile serves every `new_token_limit` up to its `max_new_tokens`.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.fp4 import GuidanceMode
from trace_jax.models import (
    ModelConfig,
    abstract_model,
    init_cache,
    init_model,
    pack_model_experts,
)
from trace_jax.quant import SiteMode
from trace_jax.rl.methods import get_method
from trace_jax.rollout.sampler import Rollout, generate
from trace_jax.rollout.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class RolloutVariant:
    """A rollout configuration: FP4 W/A/KV or bf16, the kernels ("xla" | "pallas"), what
    guidance it records: None, "method" (TRACE's compact guidance at its guided sites) or "all"
    (full codes at every FP4 site), and the model's `prefill_attention` and `predecode_experts`
    (None: the config's)."""

    fp4: bool
    implementation: str
    capture: str | None = None
    prefill_attention: str | None = None
    predecode_experts: bool | None = None

    def model_settings(self) -> dict:
        """The `ModelConfig` fields this variant sets."""
        settings = dict(
            prefill_attention=self.prefill_attention, predecode_experts=self.predecode_experts
        )
        return {name: value for name, value in settings.items() if value is not None}

    @property
    def packs_experts(self) -> bool:
        """Whether the sampler runs the experts on packed FP4 weights (it does on "pallas")."""
        return self.fp4 and self.implementation == "pallas"


ROLLOUT_VARIANTS = {
    "bf16": RolloutVariant(False, "xla"),
    "fp4": RolloutVariant(True, "pallas"),
    "fp4 + compact": RolloutVariant(True, "pallas", "method"),
    "fp4 + full": RolloutVariant(True, "pallas", "all"),
    "fp4 xla": RolloutVariant(True, "xla"),
    "bf16 + flash prefill": RolloutVariant(False, "xla", prefill_attention="auto"),
    "fp4 + flash prefill": RolloutVariant(True, "pallas", prefill_attention="auto"),
    "bf16 + cudnn prefill": RolloutVariant(False, "xla", prefill_attention="cudnn"),
    "fp4 + cudnn prefill": RolloutVariant(True, "pallas", prefill_attention="cudnn"),
    "fp4 + in-kernel decode": RolloutVariant(True, "pallas", predecode_experts=False),
    "fp4 + cudnn prefill + in-kernel decode": RolloutVariant(
        True, "pallas", prefill_attention="cudnn", predecode_experts=False
    ),
}


def variant_graphdef(cfg: ModelConfig, graphdef, variant: str):
    """The graphdef `variant` rolls out with: `graphdef` (of a model of `cfg`), or that of the
    same model with the variant's model settings (`RolloutVariant.model_settings`; the
    parameters are the same)."""
    variant_cfg = dataclasses.replace(cfg, **ROLLOUT_VARIANTS[variant].model_settings())
    if variant_cfg == cfg:
        return graphdef
    return nnx.graphdef(abstract_model(variant_cfg))


def tree_nbytes(*trees) -> int:
    """Total bytes of all array leaves (arrays or shape structs)."""
    return sum(int(x.size) * x.dtype.itemsize for t in trees for x in jax.tree.leaves(t))


def rollout_kwargs(
    cfg: ModelConfig, variant: str, new_tokens: int, fmt: str, prefill_chunk_tokens: int | None
) -> dict:
    """`generate`'s static keyword arguments for `variant` and `new_tokens` new tokens in FP4
    recipe `fmt` (`trace_jax.quant.QUANT_RECIPES`)."""
    v = ROLLOUT_VARIANTS[variant]
    setup = get_method("trace").setup(fmt, cfg.n_layers)
    keys, mode = (), GuidanceMode.COMPACT
    if v.capture == "method":
        keys, mode = setup.capture, setup.capture_mode
    elif v.capture == "all":
        keys, mode = setup.rollout_qcfg.all_keys(cfg.n_layers), GuidanceMode.FULL
    chunk = {} if prefill_chunk_tokens is None else {"prefill_chunk_tokens": prefill_chunk_tokens}
    return dict(
        sampling=SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, **chunk),  # no stop
        qcfg=setup.rollout_qcfg,
        mode=SiteMode.RTN if v.fp4 else SiteMode.OFF,
        capture=tuple(keys),
        capture_mode=mode,
        implementation=v.implementation,
    )


# How the benchmark's random model is initialized (`rollout_policy(init=...)`):
#   "selective_attention": every matrix normal(init_std), the attention's q_norm and k_norm scales
#     SELECTIVE_QK_NORM_SCALE (the other norms one). At the plain init a query's attention logits
#     have a standard deviation near 1 over hundreds of keys, so attention averages the prefix:
#     each layer writes the prompt's mean value vector into every token of the prompt, the shared
#     part of the residual stream grows layer by layer, and the routers send nearly every token
#     to the same top-k experts (docs/kernels.md, "The benchmark model's routing"). Scaling both
#     q and k norms by 4 scales the logits by 16: each query attends to a few keys (as trained
#     heads do), the residual stream stays token-specific, and the routers spread the tokens over
#     all experts as a load-balanced trained router does (the busiest expert 1.5-3.1x the mean
#     rows of a 1K prompt over 12 layers; uniform routing 1.3x). The forward is unchanged (the
#     norm scales are the model's own parameters), and no cost of the rollout depends on them
#     but the routing.
#   "normal": every matrix normal(init_std), every norm scale one (`init_model`); its routing
#     collapses (the benchmark's numbers before "selective_attention" existed).
MODEL_INITS = {  # name -> what it means for the routing (the benchmarks' notes say it)
    "selective_attention": "q/k norm scales 4, so that the routers spread a prompt's tokens "
    "over all experts",
    "normal": "the plain init, whose routers send nearly every token to the same top-k experts",
}
SELECTIVE_QK_NORM_SCALE = 4.0


def sharpen_attention(blocks, qk_norm_scale: float = SELECTIVE_QK_NORM_SCALE) -> None:
    """Sets the q_norm and k_norm scales [Dh] of every `DecoderLayer` in `blocks` (in place) to
    `qk_norm_scale`: attention logits `qk_norm_scale**2` times those of unit scales."""
    for block in blocks:
        for norm in (block.attn.q_norm, block.attn.k_norm):
            norm.scale[...] = jnp.full_like(norm.scale[...], qk_norm_scale)


def rollout_policy(
    cfg: ModelConfig, *, abstract: bool = False, init: str = "selective_attention"
) -> tuple[ModelConfig, object, object]:
    """The rollout's bf16 copy of a policy of `cfg` (the trainer keeps the fp32 master copy),
    randomly initialized on the default device as `init` says (`MODEL_INITS`), or its shapes only
    (`abstract`) -> (its config, graphdef, params). Made eagerly: one small compiled random op per
    distinct parameter shape, the same for any n_layers (one jitted init of a 12-block
    Qwen3-30B-A3B compiles for minutes on an H200). Pass the params to the rollout as arguments,
    not as constants folded into it."""
    if init not in MODEL_INITS:
        raise ValueError(f"unknown model init {init!r}; choose from {list(MODEL_INITS)}")
    cfg = dataclasses.replace(cfg, param_dtype=jnp.bfloat16)
    model = abstract_model(cfg) if abstract else init_model(cfg, seed=0)
    if init == "selective_attention" and not abstract:
        sharpen_attention(model.layers)
    graphdef, params = nnx.split(model)
    return cfg, graphdef, params


def rollout_inputs(cfg: ModelConfig, params, batch: int, prompt_len: int) -> tuple:
    """`generate`'s array arguments before the token limit: (params, random prompts int32
    `[batch, prompt_len]`, their lengths int32 `[batch]`, the sampling key)."""
    shape = (batch, prompt_len)
    prompts = jax.random.randint(jax.random.key(1), shape, 3, cfg.vocab_size, jnp.int32)
    return params, prompts, jnp.full((batch,), prompt_len, jnp.int32), jax.random.key(2)


def compile_rollout(
    cfg: ModelConfig,
    graphdef,
    inputs: tuple,
    variant: str,
    new_tokens: int,
    *,
    fmt: str,
    prefill_chunk_tokens: int | None = None,
) -> dict:
    """Compiles `variant`'s rollout of up to `new_tokens` new tokens on `inputs`
    (`rollout_inputs`) -> {"call": the compiled rollout, taking `(*inputs, new_token_limit)`,
    "compile_s", "temp_gib": XLA's temporary buffers (None where the backend does not say)}."""
    kw = rollout_kwargs(cfg, variant, new_tokens, fmt, prefill_chunk_tokens)
    graphdef = variant_graphdef(cfg, graphdef, variant)
    t0 = time.perf_counter()
    compiled = generate.lower(graphdef, *inputs, jnp.int32(new_tokens), **kw).compile()
    ready = {"call": compiled, "compile_s": time.perf_counter() - t0}
    stats = compiled.memory_analysis()
    ready["temp_gib"] = None if stats is None else stats.temp_size_in_bytes / 2**30
    return ready


def run_full_length(ready: dict, inputs: tuple, variant: str, new_tokens: int) -> Rollout:
    """Runs the compiled rollout of `compile_rollout` once at `new_tokens` (a warm-up) and
    returns it; RuntimeError unless every sequence decoded all of them (rates assume it)."""
    roll = jax.block_until_ready(ready["call"](*inputs, jnp.int32(new_tokens)))
    decoded, want = int((roll.lengths - roll.prompt_lengths).sum()), inputs[1].shape[0] * new_tokens
    if decoded != want:
        raise RuntimeError(f"{variant}: {decoded} tokens decoded, want {want}")
    return roll


def routing_balance(roll: Rollout, n_experts: int) -> dict[str, list[float]]:
    """How evenly `roll`'s router spread its rows over the experts, per layer, as the grouped
    matmuls see them (a random-init router may send nearly every token to the same few experts,
    which slows the Pallas kernels: `moe_matmul_routing_skew.md`):
    "prefill_busiest_over_mean": one prompt's rows (its tokens x top-k), the busiest expert's
      count over the mean count, the median over the batch's prompts;
    "prefill_active_experts": experts with rows in one prompt, the median over prompts;
    "decode_active_experts": experts with rows in one decode step of the whole batch (rows at
      one response slot), the mean over the steps every row decodes.
    Uniform routing of a long prompt gives a busiest-over-mean near 1.1 and every expert active
    (a decode step: `expected_active_experts`); every token on the same top_k experts gives
    n_experts / top_k (16 for 8 of 128) and top_k active experts."""
    choices = np.asarray(roll.expert_choices)  # [L, B, S, K]
    prompt_lengths, lengths = np.asarray(roll.prompt_lengths), np.asarray(roll.lengths)
    n_layers, batch, _, _ = choices.shape
    busiest, active = np.zeros((n_layers, batch)), np.zeros((n_layers, batch))
    for b in range(batch):
        prompt = choices[:, b, : prompt_lengths[b]].reshape(n_layers, -1)
        counts = np.stack([np.bincount(c, minlength=n_experts) for c in prompt])
        busiest[:, b] = counts.max(1) / counts.mean(1)
        active[:, b] = (counts > 0).sum(1)
    # Response slots every row processed: from the longest prompt to the shortest row's last.
    slots = range(int(prompt_lengths.max()), int(lengths.min()) - 1)
    decode = [
        [len(np.unique(choices[layer, :, s])) for s in slots] or [0] for layer in range(n_layers)
    ]
    return {
        "prefill_busiest_over_mean": np.median(busiest, 1).tolist(),
        "prefill_active_experts": np.median(active, 1).tolist(),
        "decode_active_experts": [float(np.mean(d)) for d in decode],
    }


def expected_active_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts that `tokens` tokens, each routed to `top_k` of `n_experts` uniformly at
    random, touch on average: E * (1 - (1 - K/E)^B)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def decode_step_bytes(
    graphdef, params, variant: str, fmt: str, batch: int, context: int
) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences at `context` cache slots must read, in
    `variant`'s storage format: "dense" weights (attention, router, norms, LM head), "embedding"
    rows of the batch, the routed "experts" it is expected to touch (`expected_active_experts`;
    packed where the sampler packs them), the "kv" cache (packed for every FP4 variant), their
    "total"; and "active_experts" per layer."""
    model = nnx.merge(graphdef, params)
    cfg, v = model.cfg, ROLLOUT_VARIANTS[variant]
    qcfg = get_method("trace").setup(fmt, cfg.n_layers).rollout_qcfg
    experts = sum(tree_nbytes(b.moe.w_gate, b.moe.w_up, b.moe.w_down) for b in model.layers)
    embedding = 0 if cfg.tie_embeddings else tree_nbytes(model.embed)  # tied: the LM head
    dense = tree_nbytes(params) - experts - embedding
    if v.packs_experts:
        packed = jax.eval_shape(lambda p: pack_model_experts(nnx.merge(graphdef, p), qcfg), params)
        experts = tree_nbytes(packed)
    kv_fmt = qcfg.kv_format if v.fp4 else None
    cache = jax.eval_shape(lambda: init_cache(cfg, batch=batch, max_len=context, kv_format=kv_fmt))
    active = expected_active_experts(cfg.n_experts, cfg.top_k, batch)
    out = {
        "dense": float(dense),
        "embedding": float(embedding * batch / cfg.vocab_size),
        "experts": experts * active / cfg.n_experts,
        "kv": float(tree_nbytes(cache.layers)),
    }
    return {**out, "total": sum(out.values()), "active_experts": active}
