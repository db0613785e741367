"""Rollout: the jitted FP4 sampler that records expert choices and rounding guidance."""

from trace_jax.rollout.memory import rollout_memory
from trace_jax.rollout.prefill import ChunkGrid, chunk_grid, prefill_in_chunks
from trace_jax.rollout.sampler import Rollout, generate
from trace_jax.rollout.sampling import (
    SamplingConfig,
    filter_logits,
    policy_logprobs,
    sample_tokens,
)

__all__ = [
    "ChunkGrid",
    "Rollout",
    "SamplingConfig",
    "chunk_grid",
    "filter_logits",
    "generate",
    "policy_logprobs",
    "prefill_in_chunks",
    "rollout_memory",
    "sample_tokens",
]
