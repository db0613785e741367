"""The rollout engine: a jitted chunked prefill + decode loop that records what FP4 really did.

Sequence layout (shared with the trainer): right-padded rows, token s of row b at slot and RoPE
position s. The prompt fills slots `[0, prompt_len)`, response token n sits at slot
`prompt_len + n`. The model processes every slot but the last token of each row, so guidance and
expert choices exist for slots `[0, length - 1)`; a trainer forward over the same rows reads them
at the same slots.

Axis legend: B batch, P prompt slots, N new tokens, S = P + N slots, L layers, K top-k, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import fp4
from trace_jax.fp4 import Guidance, GuidanceMode
from trace_jax.fp4.packed_cache import write_slots
from trace_jax.models import Qwen3MoE, decode_step, init_cache, pack_model_experts
from trace_jax.quant import QuantConfig, QuantSites, SiteMode
from trace_jax.rollout.prefill import prefill_in_chunks
from trace_jax.rollout.sampling import SamplingConfig, policy_logprobs, sample_tokens

# Named scopes of the prefill and of the decode loop (body and test: once a decode step) in the
# compiled rollout's op names (`trace_jax.rollout.collectives`, profiles).
PREFILL_SCOPE = "prefill"
DECODE_SCOPE = "decode_loop"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """What one rollout batch produced (all arrays on device).

    tokens: int32 [B, S], prompt + response, `pad_id` after each row's end.
    prompt_lengths, lengths: int32 [B], prompt length and total length (prompt + response).
    logprobs: float32 [B, S], the rollout policy's log-prob of `tokens[b, s]` at response slots
      (`policy_logprobs` at the sampling temperature), 0 elsewhere.
    response_mask: bool [B, S], the response slots.
    expert_choices: int32 [L, B, S, K], the router's top-k at every processed slot.
    guidance: site key -> `Guidance` with rows `[B, S, ...]` (valid at processed slots).
    """

    tokens: jax.Array
    prompt_lengths: jax.Array
    lengths: jax.Array
    logprobs: jax.Array
    response_mask: jax.Array
    expert_choices: jax.Array
    guidance: dict[str, Guidance]

    @property
    def processed(self) -> jax.Array:
        """bool [B, S]: slots the rollout's model processed (all but each row's last token)."""
        s = jnp.arange(self.tokens.shape[1])
        return s[None, :] < (self.lengths - 1)[:, None]

    def rows(self, index) -> Rollout:
        """The rollout restricted to batch rows `index` (a slice or int array), guidance too."""

        def take(a):
            return a[index]

        return Rollout(
            tokens=take(self.tokens),
            prompt_lengths=take(self.prompt_lengths),
            lengths=take(self.lengths),
            logprobs=take(self.logprobs),
            response_mask=take(self.response_mask),
            expert_choices=self.expert_choices[:, index],
            guidance={k: jax.tree.map(take, g) for k, g in self.guidance.items()},
        )

    @property
    def guidance_bytes(self) -> int:
        """Bytes of the guidance buffers (all slots, as stored)."""
        return sum(g.nbytes for g in self.guidance.values())


def _write_slots(buf: jax.Array, value: jax.Array, slots: jax.Array, axis: int = 1) -> jax.Array:
    """Writes `value` with `[B, T]` at `slots [B, T]` of `buf` along `axis` (B is axis - 1)."""
    buf_m = jnp.moveaxis(buf, (axis - 1, axis), (0, 1))
    val_m = jnp.moveaxis(value, (axis - 1, axis), (0, 1))
    out = write_slots(buf_m, val_m, slots)  # one scatter per row: no gathers on a mesh
    return jnp.moveaxis(out, (0, 1), (axis - 1, axis))


def _guidance_buffer(g: Guidance, batch: int, n_slots: int) -> Guidance:
    """An empty `[batch, n_slots, ...]` buffer shaped like the `[B', T, ...]` guidance `g`."""

    def shape(a):
        return (batch, n_slots, *a.shape[2:])

    gs = None if g.global_scale is None else jnp.ones(shape(g.global_scale), jnp.float32)
    return Guidance(
        jnp.zeros(shape(g.payload), jnp.uint8),
        fp4.empty_scales(shape(g.scales), g.fmt),
        gs,
        None,
        g.fmt,
        g.mode,
    )


def _map_guidance(fn, *gs: Guidance) -> Guidance:
    """Applies `fn` to the payload, scales and global scale (where present) of guidance `gs`."""
    g0 = gs[0]

    def part(name):
        parts = [getattr(g, name) for g in gs]
        return None if parts[0] is None else fn(*parts)

    return Guidance(part("payload"), part("scales"), part("global_scale"), None, g0.fmt, g0.mode)


def pack_rows(leaves: list[jax.Array]) -> jax.Array:
    """Concatenates arrays `[B, ...]` of any dtypes into one byte row per batch row.

    Returns uint8 [B, total bytes]. A decode step records ~50 small arrays (expert choices; the
    payload, scales and global scale of every captured site); written one by one into their
    buffers they cost one GPU kernel each: +7.5-10% of a `small` decode step on the H200, and no
    measurable cost once packed.
    """
    parts = []
    for a in leaves:
        u = a if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, jnp.uint8)
        parts.append(u.reshape(a.shape[0], -1))
    return jnp.concatenate(parts, axis=1)


def unpack_rows(packed: jax.Array, like: list[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    """Inverse of `pack_rows`: uint8 `[..., B, bytes]` -> arrays `[..., *like[i].shape]`."""
    lead, out, offset = packed.shape[:-1], [], 0
    for a in like:
        size = jnp.dtype(a.dtype).itemsize
        n = math.prod(a.shape[1:]) * size
        chunk = packed[..., offset : offset + n]
        offset += n
        tail = () if size == 1 else (size,)
        chunk = chunk.reshape(*lead, *a.shape[1:], *tail)
        out.append(chunk if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(chunk, a.dtype))
    if offset != packed.shape[-1]:
        raise ValueError(f"rows of {packed.shape[-1]} bytes do not hold {offset} bytes of arrays")
    return out


def _captures(sites: QuantSites, mode: GuidanceMode) -> dict[str, Guidance]:
    return sites.captured_guidance(mode)


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "sampling",
        "qcfg",
        "mode",
        "capture",
        "capture_mode",
        "implementation",
        "residual_fraction",
    ),
)
def generate(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    new_token_limit: jax.Array | int | None = None,
    *,
    sampling: SamplingConfig,
    qcfg: QuantConfig,
    mode: SiteMode = SiteMode.RTN,
    capture: tuple[str, ...] = (),
    capture_mode: GuidanceMode = GuidanceMode.COMPACT,
    implementation: str = "xla",
    residual_fraction: float = 0.0,
) -> Rollout:
    """Samples `sampling.max_new_tokens` tokens (or `new_token_limit`) after each right-padded
    prompt; rows end early at a stop token.

    Args:
      graphdef, params: `nnx.split(model)` of a `Qwen3MoE`.
      prompts: int32 [B, P], right-padded; `prompt_lengths` int32 [B] in [1, P].
      key: PRNG key; step n samples with `fold_in(key, n)`.
      new_token_limit: int32 scalar, traced (one compiled rollout serves every value): rows stop
        after this many new tokens, clipped to [1, max_new_tokens]; the buffers keep their
        `max_new_tokens` slots. None: `max_new_tokens` (bit for bit the same rollout). Limit 1
        is the prefill and the first sample: one compile times prefill and whole rollouts.
      sampling: temperature, top-k/top-p, stop tokens, length, and the prompt prefill's chunk
        size (`prefill_chunk_tokens`, see `trace_jax.rollout.prefill`).
      qcfg, mode: the FP4 recipe and SiteMode.RTN (FP4 rollout) or SiteMode.OFF (BF16 rollout).
      capture: site keys whose rounding decisions to record (e.g. `qcfg.guided_keys(L)`).
      capture_mode: "compact" or "full" guidance.
      implementation: "xla" (plain XLA), or "pallas" for the Pallas FP4 kernel ops (fused
        quantize + capture at the FP4 sites and KV writes, FP4 decode attention over the packed
        cache, and the FP4 MoE matmul over expert weights packed once per call; elsewhere than
        a GPU or a TPU only inside `kernels_pallas.common.interpreting`); both record identical
        codes and guidance where their inputs agree. It reaches the model through the sites
        (`QuantSites(implementation=...)`).
      residual_fraction: QUADS' residual activation compensation (see `QuantSites`); 0 = off.
    """
    model: Qwen3MoE = nnx.merge(graphdef, params)
    cfg = model.cfg
    b, p = prompts.shape
    n_new = sampling.max_new_tokens
    s_total = p + n_new
    mode = SiteMode(mode)
    if mode is SiteMode.GUIDED:
        raise ValueError("the rollout quantizes with SiteMode.RTN (FP4) or SiteMode.OFF (BF16)")
    stop = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)
    limit = n_new
    if new_token_limit is not None:
        new_token_limit = jnp.asarray(new_token_limit)
        if new_token_limit.ndim or not jnp.issubdtype(new_token_limit.dtype, jnp.integer):
            raise ValueError(
                f"new_token_limit must be an integer scalar, got {new_token_limit.dtype} with "
                f"shape {new_token_limit.shape}"
            )
        limit = jnp.clip(new_token_limit, 1, n_new).astype(jnp.int32)

    packed_experts = None
    # FP4 weights are quantized and packed once per rollout (one policy version), and the experts
    # run the Pallas FP4 MoE matmul on them, instead of fake-quantizing every step. Weights that
    # already hold post-training-quantized values are not packed (RTN packing would re-quantize
    # them with other scales): their experts run ragged_dot on those values, and attention and
    # activation quantization still use the Pallas kernels.
    if (
        implementation == "pallas"
        and mode is SiteMode.RTN
        and not residual_fraction
        and not qcfg.weights_prequantized
    ):
        packed_experts = pack_model_experts(model, qcfg)

    def new_sites():
        return QuantSites(
            qcfg,
            cfg.n_layers,
            mode,
            capture=capture,
            differentiable=False,
            implementation=implementation,
            residual_fraction=residual_fraction,
            packed_experts=packed_experts,
        )

    # Prefill the prompts in chunks of at most `sampling.prefill_chunk_tokens` tokens, recording
    # each token's expert choices [B, T, L, K] and captured guidance at its slot.
    kv_format = qcfg.kv_format if mode is SiteMode.RTN else None
    cache = init_cache(cfg, batch=b, max_len=s_total, kv_format=kv_format)

    def prefill_records(aux, sites):  # guidance without a mask, the buffers' structure
        captured = _captures(sites, capture_mode)
        guidance = {k: _map_guidance(lambda a: a, g) for k, g in captured.items()}
        return jnp.moveaxis(aux["topk_idx"], 0, 2), guidance

    def record_buffers(like):
        experts_like, guidance_like = like
        experts = jnp.zeros((b, s_total, *experts_like.shape[2:]), jnp.int32)
        return experts, {k: _guidance_buffer(g, b, s_total) for k, g in guidance_like.items()}

    with jax.named_scope(PREFILL_SCOPE):
        last_logits, cache, (experts, guidance) = prefill_in_chunks(
            model,
            cache,
            prompts,
            prompt_lengths,
            chunk_tokens=sampling.prefill_chunk_tokens,
            new_site=new_sites,
            records=prefill_records,
            record_buffers=record_buffers,
        )
    experts = jnp.moveaxis(experts, 2, 0)  # [L, B, S, K]
    tokens = jnp.full((b, s_total), sampling.pad_id, jnp.int32)
    tokens = jax.lax.dynamic_update_slice(tokens, prompts.astype(jnp.int32), (0, 0))
    logprobs = jnp.zeros((b, s_total), jnp.float32)

    def sample_at(n, logits, tokens, logprobs, done, lengths):
        tok = sample_tokens(logits, jax.random.fold_in(key, n), sampling)
        lp = jnp.take_along_axis(policy_logprobs(logits, sampling.temperature), tok[:, None], 1)
        tok = jnp.where(done, sampling.pad_id, tok)
        slot = jnp.where(done, s_total, lengths)[:, None]  # finished rows write nowhere
        tokens = _write_slots(tokens, tok[:, None], slot)
        logprobs = _write_slots(logprobs, lp, slot)
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(tok, stop)
        return tok, tokens, logprobs, done, lengths

    done = jnp.zeros((b,), bool)
    tok, tokens, logprobs, done, lengths = sample_at(
        0, last_logits, tokens, logprobs, done, prompt_lengths
    )

    def cond(state):
        n, done = state[0], state[4]
        return (n < limit) & ~jnp.all(done)

    # Decode step n (1 <= n < n_new) feeds each active row's token at slot `prompt_len + n - 1`.
    # Its expert choices and guidance go to step-indexed buffers (entry n - 1) and are moved to
    # those slots once after the loop.
    n_steps = max(n_new - 1, 1)

    def step_records(aux, sites) -> list[jax.Array]:  # one decode step's records, batch first
        leaves = jax.tree.leaves(_captures(sites, capture_mode))
        return [jnp.moveaxis(aux["topk_idx"], 1, 0), *leaves]  # experts [B, L, 1, K]

    record_shapes = [
        jax.ShapeDtypeStruct((b, cfg.n_layers, 1, cfg.top_k), jnp.int32),
        *(jax.ShapeDtypeStruct((b, 1, *a.shape[2:]), a.dtype) for a in jax.tree.leaves(guidance)),
    ]
    row_bytes = sum(math.prod(a.shape[1:]) * jnp.dtype(a.dtype).itemsize for a in record_shapes)
    steps0 = jnp.zeros((n_steps, b, row_bytes), jnp.uint8)

    def body(state):
        n, tok, tokens, logprobs, done, lengths, cache, steps = state
        sites = new_sites()
        logits, aux, cache = decode_step(model, cache, tok, site=sites, active=~done)
        row = pack_rows(step_records(aux, sites))
        steps = jax.lax.dynamic_update_index_in_dim(steps, row, n - 1, 0)  # in place
        tok, tokens, logprobs, done, lengths = sample_at(n, logits, tokens, logprobs, done, lengths)
        return n + 1, tok, tokens, logprobs, done, lengths, cache, steps

    state = (1, tok, tokens, logprobs, done, lengths, cache, steps0)
    with jax.named_scope(DECODE_SCOPE):
        state = jax.lax.while_loop(cond, body, state)
    _, _, tokens, logprobs, _, lengths, _, steps = state
    # Step j fed slot prompt_len + j; slots at or after a row's last token were not processed
    # (the row had finished, or the loop stopped) and keep their empty values.
    j = jnp.arange(n_steps, dtype=jnp.int32)[None, :]
    step_slots = prompt_lengths[:, None] + j
    step_slots = jnp.where(step_slots < (lengths - 1)[:, None], step_slots, s_total)
    expert_steps, *guidance_steps = unpack_rows(steps, record_shapes)  # [T, B, ...]
    expert_steps = jnp.transpose(expert_steps[:, :, :, 0], (2, 1, 0, 3))  # [L, B, T, K]
    experts = _write_slots(experts, expert_steps, step_slots, axis=2)
    flat, treedef = jax.tree.flatten(guidance)
    flat = [
        _write_slots(buf, jnp.moveaxis(v[:, :, 0], 0, 1), step_slots)
        for buf, v in zip(flat, guidance_steps, strict=True)
    ]
    guidance = jax.tree.unflatten(treedef, flat)
    s = jnp.arange(s_total)[None, :]
    response_mask = (s >= prompt_lengths[:, None]) & (s < lengths[:, None])
    return Rollout(
        tokens=tokens,
        prompt_lengths=prompt_lengths,
        lengths=lengths,
        logprobs=jnp.where(response_mask, logprobs, 0.0),
        response_mask=response_mask,
        expert_choices=experts,
        guidance=guidance,
    )
