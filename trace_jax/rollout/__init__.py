"""Rollout: the jitted FP4 sampler that records expert choices and rounding guidance."""

from trace_jax.rollout.sampler import Rollout, generate
from trace_jax.rollout.sampling import (
    SamplingConfig,
    filter_logits,
    policy_logprobs,
    sample_tokens,
)

__all__ = [
    "Rollout",
    "SamplingConfig",
    "filter_logits",
    "generate",
    "policy_logprobs",
    "sample_tokens",
]
