"""Token sampling: temperature, top-k and top-p (nucleus) filtering, pure functions."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the rollout samples.

    Attributes:
      max_new_tokens: response length limit N.
      temperature: softmax temperature; 0 means greedy (argmax).
      top_k: keep the k most likely tokens (0: off).
      top_p: keep the smallest set of tokens whose probability reaches top_p (1.0: off).
      stop_tokens: a sampled stop token ends its sequence (it is part of the response).
      pad_id: filler after a sequence ended.
      prefill_chunk_tokens: the prompt prefill runs in chunks of at most this many tokens
        (`trace_jax.rollout.prefill`), which bounds its temporaries: the default keeps a
        Qwen3-30B-A3B-shaped bf16 rollout of 12 layers at batch 64 x 8K prompts at 27 GiB of them
        (XLA's CPU compile). Chunks of whole prompts (prompts up to this length) change no
        result; longer prompts are cut into chunks of positions, which sum in another order.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0
    prefill_chunk_tokens: int = 8192

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        chunk = self.prefill_chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
            raise ValueError(f"prefill_chunk_tokens must be an int >= 1, got {chunk!r}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


def policy_logprobs(logits: jax.Array, temperature: float) -> jax.Array:
    """log-softmax of `logits [..., V]` at the sampling temperature (1 when greedy), float32.

    This is the policy both rollout and trainer report log-probs under (no top-k/top-p).
    """
    t = 1.0 if temperature == 0 else temperature
    return jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)


def filter_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Masks `logits [B, V]` outside top-k and top-p with a large negative number."""
    logits = logits.astype(jnp.float32)
    if cfg.top_k:
        kth = jax.lax.top_k(logits, min(cfg.top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, _NEG_INF, logits)
    if cfg.top_p < 1.0:
        t = 1.0 if cfg.temperature == 0 else cfg.temperature
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits / t, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep_sorted = before < cfg.top_p  # always keeps the top token
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, _NEG_INF)
    return logits


def sample_tokens(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Samples one token per row of `logits [B, V]` (int32 [B])."""
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, cfg)
    return jax.random.categorical(key, filtered / cfg.temperature, axis=-1).astype(jnp.int32)
