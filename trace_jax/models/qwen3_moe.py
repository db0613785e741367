"""Qwen3-MoE-style decoder in Flax NNX: full-sequence forward, cached prefill and decode.

Axis legend: B batch, T time, S cache slots, D model, V vocab, L layers, E experts, K top-k.

Block: `x += attn(norm(x)); x += moe(norm(x))`, then a final norm and the LM head. Parameters are
stored in `cfg.param_dtype` and cast to `cfg.dtype` for compute; logits are float32.

Aux dict returned by every forward (per layer stacked on a leading L axis):
  "router_aux_loss": scalar float32, mean over layers of the unscaled Switch loss on valid tokens
    (the trainer adds `cfg.router_aux_loss_coef * aux["router_aux_loss"]`).
  "router_aux_loss_per_layer": [L] float32.
  "topk_idx": [L, B, T, K] int32, the experts used (record these for routing replay).
  "topk_weights": [L, B, T, K] float32, their combine weights.
  "router_probs": [L, B, T, E] float32, the router softmax.

Cache convention: see `trace_jax.models.attention` (right padding, slot == position).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.models.attention import (
    Attention,
    AttentionMask,
    CacheMask,
    KVCache,
    LayerKVCache,
    RMSNorm,
    causal_mask,
)
from trace_jax.models.config import (
    ModelConfig,
    QuantSite,
    identity_site,
    site_records,
    take_written_records,
)
from trace_jax.models.moe import MoE, MoEImpl, PackedExperts, Routing, pack_experts


class DecoderLayer(nnx.Module):
    """Pre-norm attention block and pre-norm MoE block, each with a residual connection."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        norm = dict(eps=cfg.rms_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        self.moe = MoE(cfg, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        *,
        layer: int,
        positions: jax.Array,
        mask: AttentionMask,
        valid: jax.Array,
        site: QuantSite,
        expert_choices: jax.Array | None,
        cache: LayerKVCache | None,
        slots: jax.Array | None,
        moe_impl: MoEImpl,
        moe_per_device: bool = False,
    ) -> tuple[jax.Array, Routing, jax.Array, LayerKVCache | None]:
        """x [B, T, D] -> (x [B, T, D], routing, aux loss, updated layer cache or None).
        moe_per_device: `MoE`'s `per_device` (inference only)."""
        with jax.named_scope("attention"):
            y, cache = self.attn(
                self.attn_norm(x),
                positions=positions,
                mask=mask,
                layer=layer,
                site=site,
                cache=cache,
                slots=slots,
            )
            x = x + y
        with jax.named_scope("moe"):
            y, routing, aux_loss = self.moe(
                self.mlp_norm(x),
                layer=layer,
                site=site,
                expert_choices=expert_choices,
                valid=valid,
                impl=moe_impl,
                per_device=moe_per_device,
            )
            x = x + y
        return x, routing, aux_loss, cache


def checkpointed_block(
    block: DecoderLayer,
    x: jax.Array,
    expert_choices: jax.Array | None,
    site: QuantSite,
    **kw,
) -> tuple[jax.Array, Routing, jax.Array, None]:
    """`block(x, ...)` without a cache under `nnx.remat`: the backward recomputes the block from
    `x` [B, T, D] instead of keeping its activations. A stateful site records what it sees in
    Python dicts (`site_records`); entries written inside the checkpoint's trace would leak its
    tracers, so the entries this call writes leave the checkpoint as outputs and are written back
    outside."""
    records = site_records(site)
    before = {name: dict(d) for name, d in records.items()}

    def body(block, x, expert_choices):
        out = block(x, site=site, expert_choices=expert_choices, cache=None, slots=None, **kw)
        return out, take_written_records(records, before)

    out, written = nnx.remat(body)(block, x, expert_choices)
    for name, entries in written.items():
        records[name].update(entries)
    return out


class Qwen3MoE(nnx.Module):
    """The decoder. Params: embed [V, D]; layers[i] (see DecoderLayer); final_norm; lm_head [D, V]
    (None when `cfg.tie_embeddings`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        self.embed = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.d_model), cfg.param_dtype))
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(
            cfg.d_model, eps=cfg.rms_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype
        )
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nnx.Param(init(rngs.params(), (cfg.d_model, cfg.vocab_size), cfg.param_dtype))
        )
        self.cfg = cfg

    # ------------------------------------------------------------------------------- pieces

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int -> [B, T, D] in the compute dtype."""
        return jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.dtype)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: [B, T, D] -> [B, T, V] float32."""
        dt = self.cfg.dtype
        x = self.final_norm(x)
        if self.lm_head is None:
            return jnp.einsum(
                "btd,vd->btv", x, self.embed[...].astype(dt), preferred_element_type=jnp.float32
            )
        return jnp.einsum(
            "btd,dv->btv", x, self.lm_head[...].astype(dt), preferred_element_type=jnp.float32
        )

    def _check_choices(self, expert_choices: jax.Array | None, b: int, t: int) -> None:
        cfg = self.cfg
        expected = (cfg.n_layers, b, t, cfg.top_k)
        if expert_choices is not None and expert_choices.shape != expected:
            raise ValueError(
                f"expert_choices has shape {expert_choices.shape}, expected {expected} [L, B, T, K]"
            )

    def _run(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array,
        mask: AttentionMask,
        valid: jax.Array,
        site: QuantSite,
        expert_choices: jax.Array | None,
        caches: tuple[LayerKVCache, ...] | None,
        slots: jax.Array | None,
        moe_impl: MoEImpl,
    ) -> tuple[jax.Array, dict[str, jax.Array], tuple[LayerKVCache, ...] | None]:
        """The blocks over `tokens [B, T]`: (hidden [B, T, D] before the final norm, aux,
        caches)."""
        b, t = tokens.shape
        self._check_choices(expert_choices, b, t)
        x = self.embed_tokens(tokens)
        routings, aux_losses, new_caches = [], [], []
        # Cached inference (the rollout) routes each device's rows on its device; the trainer's
        # forward (no cache, differentiated) keeps GSPMD's routing and its gradient sums.
        per_device = caches is not None and self.cfg.moe_routing_per_device
        for i, block in enumerate(self.layers):
            kw = dict(
                layer=i, positions=positions, mask=mask, valid=valid, moe_impl=moe_impl,
                moe_per_device=per_device,
            )  # fmt: skip
            choices = None if expert_choices is None else expert_choices[i]
            with jax.named_scope(f"layer_{i}"):
                if self.cfg.remat and caches is None:
                    x, routing, aux_loss, cache = checkpointed_block(block, x, choices, site, **kw)
                else:
                    x, routing, aux_loss, cache = block(
                        x,
                        site=site,
                        expert_choices=choices,
                        cache=None if caches is None else caches[i],
                        slots=slots,
                        **kw,
                    )
            routings.append(routing)
            aux_losses.append(aux_loss)
            new_caches.append(cache)
        per_layer = jnp.stack(aux_losses)
        aux = {
            "router_aux_loss": jnp.mean(per_layer),
            "router_aux_loss_per_layer": per_layer,
            "topk_idx": jnp.stack([r.topk_idx for r in routings]),
            "topk_weights": jnp.stack([r.topk_weights for r in routings]),
            "router_probs": jnp.stack([r.probs for r in routings]),
        }
        return x, aux, None if caches is None else tuple(new_caches)

    # ------------------------------------------------------------------------------ forward

    def __call__(
        self,
        tokens: jax.Array,
        *,
        mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        site: QuantSite = identity_site,
        expert_choices: jax.Array | None = None,
        moe_impl: MoEImpl | str = MoEImpl.GROUPED,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Teacher-forced forward of `tokens [B, T]` (int32), without a cache.

        mask [B, T] bool: real tokens (default all); padding may be on either side. Keys are
          attended causally by slot and only where `mask` is set; padded queries give junk.
        positions [B, T] int32: RoPE positions (default `cumsum(mask) - 1`, clipped at 0, so a
          left-padded row gets the same positions as unpadded).
        expert_choices [L, B, T, K] int32: routing replay.
        Returns (logits [B, T, V] float32, aux dict; see the module docstring).
        """
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
        valid = jnp.ones(tokens.shape, jnp.bool_) if mask is None else jnp.asarray(mask, jnp.bool_)
        if valid.shape != tokens.shape:
            raise ValueError(f"mask shape {valid.shape} != tokens shape {tokens.shape}")
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)
        hidden, aux, _ = self._run(
            tokens,
            positions=positions,
            mask=causal_mask(valid),
            valid=valid,
            site=site,
            expert_choices=expert_choices,
            caches=None,
            slots=None,
            moe_impl=MoEImpl(moe_impl),
        )
        return self.logits(hidden), aux


# ----------------------------------------------------------------------------- cached inference


def forward_cached(
    model: Qwen3MoE,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    site: QuantSite = identity_site,
    expert_choices: jax.Array | None = None,
    from_start: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array], KVCache]:
    """Runs `tokens [B, T]` at slots and RoPE `positions [B, T]` (int32) of a cache whose
    `lengths` already count them: their k, v are written at those slots, and the query at
    position t attends slots `s <= t` with `s < cache.lengths[b]`, whatever else the cache holds.

    The cache is not advanced (the caller sets `lengths`); tokens at `positions >= lengths` are
    padding (their outputs are junk, their aux rows are not valid). A prompt prefilled in pieces of
    positions this way computes every query over exactly the keys of the one-piece prefill
    (`trace_jax.rollout.prefill_in_chunks`). Returns (hidden [B, T, D] in the compute dtype, before
    the final norm: `model.logits(hidden)` gives the logits; aux; cache). `from_start` (static)
    promises positions 0 .. T-1 in every row (`CacheMask.from_start`), which lets a prefill
    attention that only expresses causal attention from slot 0 serve the chunk.
    """
    tokens = jnp.asarray(tokens)
    b, t = tokens.shape
    if b != cache.batch:
        raise ValueError(f"tokens batch {b} != cache batch {cache.batch}")
    if t > cache.max_len:
        raise ValueError(f"{t} tokens do not fit a cache of max_len {cache.max_len}")
    positions = jnp.asarray(positions, jnp.int32)
    if positions.shape != (b, t):
        raise ValueError(f"positions must be [B, T]={(b, t)}, got shape {positions.shape}")
    hidden, aux, layers = model._run(
        tokens,
        positions=positions,
        mask=CacheMask(positions, cache.lengths, cache.max_len, from_start=from_start),
        valid=positions < cache.lengths[:, None],
        site=site,
        expert_choices=expert_choices,
        caches=cache.layers,
        slots=positions,
        moe_impl=MoEImpl.GROUPED,
    )
    return hidden, aux, KVCache(layers=layers, lengths=cache.lengths)


def prefill(
    model: Qwen3MoE,
    cache: KVCache,
    tokens: jax.Array,
    lengths: jax.Array,
    *,
    site: QuantSite = identity_site,
    expert_choices: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], KVCache]:
    """Append right-padded `tokens [B, T]` (the first `lengths[b]` real) to the cache.

    Token t of sequence b goes to slot and position `cache.lengths[b] + t`; from an empty cache
    this is the prompt prefill, otherwise a continuation (chunked prefill). Returns
    (logits [B, T, V] float32, aux, cache with `lengths += lengths`). The next-token logits of
    sequence b are `logits[b, lengths[b] - 1]`. The caller keeps `cache.lengths + lengths <=
    cache.max_len` (writes past the end are dropped).
    """
    tokens = jnp.asarray(tokens)
    b, t = tokens.shape
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B]=({b},), got shape {lengths.shape}")
    if b != cache.batch:
        raise ValueError(f"tokens batch {b} != cache batch {cache.batch}")
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    advanced = KVCache(layers=cache.layers, lengths=cache.lengths + lengths)
    hidden, aux, cache = forward_cached(
        model, advanced, tokens, positions, site=site, expert_choices=expert_choices
    )
    return model.logits(hidden), aux, cache


def decode_step(
    model: Qwen3MoE,
    cache: KVCache,
    tokens: jax.Array,
    *,
    site: QuantSite = identity_site,
    expert_choices: jax.Array | None = None,
    active: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], KVCache]:
    """One token per sequence, `tokens [B]`, at slot and position `cache.lengths[b]`.

    active [B] bool: sequences that advance (default all); an inactive one writes a masked slot
    and keeps its length. expert_choices [L, B, 1, K] replays routing.
    Returns (logits [B, V] float32, aux with T = 1, cache).
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"decode_step tokens must be [B], got shape {tokens.shape}")
    n_new = jnp.ones(tokens.shape, jnp.int32) if active is None else jnp.asarray(active, jnp.int32)
    logits, aux, cache = prefill(
        model, cache, tokens[:, None], n_new, site=site, expert_choices=expert_choices
    )
    return logits[:, 0], aux, cache


def pack_model_experts(model: Qwen3MoE, qcfg) -> dict[int, PackedExperts]:
    """Every layer's routed-expert weights packed for the Pallas FP4 MoE kernel (once per policy
    version, see `QuantSites(packed_experts=...)`); `qcfg` gives the weight formats."""
    return {
        i: pack_experts(block.moe, qcfg, model.cfg.dtype) for i, block in enumerate(model.layers)
    }


# ------------------------------------------------------------------------ jitted entry points


@functools.partial(jax.jit, static_argnames=("graphdef", "site", "moe_impl"))
def forward_jit(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    mask: jax.Array | None = None,
    positions: jax.Array | None = None,
    expert_choices: jax.Array | None = None,
    *,
    site: QuantSite = identity_site,
    moe_impl: MoEImpl = MoEImpl.GROUPED,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`Qwen3MoE.__call__` of `nnx.merge(graphdef, params)`, jitted; `site` is static."""
    model = nnx.merge(graphdef, params)
    return model(
        tokens,
        mask=mask,
        positions=positions,
        site=site,
        expert_choices=expert_choices,
        moe_impl=moe_impl,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "site"), donate_argnames=("cache",))
def prefill_jit(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: KVCache,
    tokens: jax.Array,
    lengths: jax.Array,
    expert_choices: jax.Array | None = None,
    *,
    site: QuantSite = identity_site,
) -> tuple[jax.Array, dict[str, jax.Array], KVCache]:
    """`prefill` jitted on `(graphdef, params) = nnx.split(model)`; donates the cache."""
    model = nnx.merge(graphdef, params)
    return prefill(model, cache, tokens, lengths, site=site, expert_choices=expert_choices)


@functools.partial(jax.jit, static_argnames=("graphdef", "site"), donate_argnames=("cache",))
def decode_step_jit(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: KVCache,
    tokens: jax.Array,
    expert_choices: jax.Array | None = None,
    active: jax.Array | None = None,
    *,
    site: QuantSite = identity_site,
) -> tuple[jax.Array, dict[str, jax.Array], KVCache]:
    """`decode_step` jitted on `(graphdef, params) = nnx.split(model)`; donates the cache."""
    model = nnx.merge(graphdef, params)
    return decode_step(
        model, cache, tokens, site=site, expert_choices=expert_choices, active=active
    )


# ------------------------------------------------------------------------------------- helpers


def abstract_model(cfg: ModelConfig) -> Qwen3MoE:
    """The model with `jax.ShapeDtypeStruct` leaves (nothing allocated), via `nnx.eval_shape`."""
    return nnx.eval_shape(lambda: Qwen3MoE(cfg, rngs=nnx.Rngs(0)))


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters of `Qwen3MoE(cfg)`, from shapes only (safe at paper scale)."""
    leaves = jax.tree.leaves(nnx.state(abstract_model(cfg), nnx.Param))
    return sum(int(x.size) for x in leaves)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters touched per token: all but the (E - K) unused routed experts."""
    per_expert = 3 * cfg.d_model * cfg.d_ff_expert
    return param_count(cfg) - cfg.n_layers * (cfg.n_experts - cfg.top_k) * per_expert


def init_model(cfg: ModelConfig, *, seed: int = 0) -> Qwen3MoE:
    """A randomly initialized model."""
    return Qwen3MoE(cfg, rngs=nnx.Rngs(seed))
