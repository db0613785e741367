"""Group-relative advantages (GRPO, Dr. GRPO): pure `jnp` functions in an explicit registry.

Every prompt is sampled G times; a sample's advantage is its reward relative to its group:

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)        "grpo"
    A_i =  r_i - mean_g(r)                            "dr_grpo" (no std normalization)

The advantage is one number per sequence; the losses broadcast it over the response tokens.

Axis legend: P prompts, G samples per prompt (group), N = P * G sequences.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _grouped(rewards: jax.Array, group_size: int | None) -> jax.Array:
    """`rewards` as float32 [P, G]: [P, G] passes through, [N] is split into groups of G."""
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim == 2:
        if group_size is not None and group_size != r.shape[1]:
            raise ValueError(
                f"rewards of shape {r.shape} are [P, G] with G={r.shape[1]}, "
                f"but group_size={group_size}"
            )
        return r
    if r.ndim != 1:
        raise ValueError(f"rewards must be [P*G] or [P, G]; got shape {r.shape}")
    if group_size is None:
        raise ValueError("flat rewards [P*G] need group_size")
    if group_size < 1 or r.shape[0] % group_size:
        raise ValueError(
            f"{r.shape[0]} rewards do not split into groups of group_size={group_size}"
        )
    return r.reshape(-1, group_size)


def grpo_advantages(
    rewards: jax.Array,
    group_size: int | None = None,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    ddof: int = 1,
) -> jax.Array:
    """Group-normalized advantages, float32 with the shape of `rewards`.

    Args:
      rewards: [P*G] (groups contiguous: sample g of prompt p at p*G + g) or [P, G].
      group_size: G; required for flat rewards, checked against [P, G] rewards.
      std_normalize: divide by the group's standard deviation (GRPO); False gives Dr. GRPO's
        mean-centred advantages.
      eps: added to the standard deviation (a group of equal rewards gets advantage 0).
      ddof: delta degrees of freedom of the standard deviation; 1 (the unbiased estimate, as in
        the common GRPO implementations) needs G >= 2.
    """
    grouped = _grouped(rewards, group_size)
    if std_normalize and grouped.shape[1] <= ddof:
        raise ValueError(f"group size {grouped.shape[1]} is too small for a std with ddof={ddof}")
    centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
    if std_normalize:
        centred = centred / (jnp.std(grouped, axis=1, ddof=ddof, keepdims=True) + eps)
    return centred.reshape(jnp.shape(rewards))


AdvantageFn = Callable[..., jax.Array]

# name -> fn(rewards, group_size, *, eps) -> advantages with the shape of `rewards`.
ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": functools.partial(grpo_advantages, std_normalize=True),
    "dr_grpo": functools.partial(grpo_advantages, std_normalize=False),
}


def get_advantage_fn(name: str) -> AdvantageFn:
    """The advantage estimator called `name` (see `ADVANTAGES`)."""
    if name not in ADVANTAGES:
        raise ValueError(
            f"unknown advantage estimator {name!r}; expected one of {sorted(ADVANTAGES)}"
        )
    return ADVANTAGES[name]
