"""RL update: GRPO advantages, policy losses (PPO-clip + truncated IS, TBPO), gap metrics,
the `GRPOConfig` and its optimizer, and the registry of compared methods."""

from trace_jax.rl.advantages import ADVANTAGES, get_advantage_fn, grpo_advantages
from trace_jax.rl.config import GRPOConfig, make_optimizer, make_schedule
from trace_jax.rl.losses import (
    AGGREGATIONS,
    LOSSES,
    aggregate,
    get_loss_fn,
    kl_k3,
    logprob_gap_metrics,
    masked_mean,
    ppo_clip_loss,
    tbpo_loss,
    truncated_is_weight,
)
from trace_jax.rl.methods import (
    FORMAT_PRESETS,
    METHODS,
    Method,
    MethodSetup,
    bind_loss,
    deeper_layers,
    get_method,
    quant_preset,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "FORMAT_PRESETS",
    "LOSSES",
    "METHODS",
    "GRPOConfig",
    "Method",
    "MethodSetup",
    "aggregate",
    "bind_loss",
    "deeper_layers",
    "get_advantage_fn",
    "get_loss_fn",
    "get_method",
    "grpo_advantages",
    "kl_k3",
    "logprob_gap_metrics",
    "make_optimizer",
    "make_schedule",
    "masked_mean",
    "ppo_clip_loss",
    "quant_preset",
    "tbpo_loss",
    "truncated_is_weight",
]
