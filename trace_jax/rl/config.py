"""`GRPOConfig`: the RL update's hyper-parameters (SPEC 6), and the optimizer they define."""

from __future__ import annotations

import dataclasses
import functools

import jax
import optax

from trace_jax.rl.advantages import ADVANTAGES
from trace_jax.rl.config_dict import Checks, finite_number
from trace_jax.rl.losses import AGGREGATIONS


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """GRPO with truncated importance sampling, routing replay and bounded staleness.

    Fields and the symbols they stand for (see `trace_jax.rl.losses` for the objectives):

      group_size: G, samples per prompt (the paper: 8-16).
      advantage: the estimator in `ADVANTAGES`: "grpo" A = (r - mean_G r) / (std_G r + eps_adv)
        or "dr_grpo" A = r - mean_G r.
      adv_eps: eps_adv.
      clip_eps_low, clip_eps_high: eps_low, eps_high; the ratio r = pi_theta / pi_old is clipped
        to [1 - eps_low, 1 + eps_high] (eps_high > eps_low is DAPO's "clip higher").
      is_cap: C, the token-level importance weight pi_old / pi_roll is truncated at C (the
        paper: 5); None turns the correction off.
      beta: beta, the weight of the k3 KL(pi_theta || pi_ref) penalty (0: no reference model).
      dual_clip: c, PPO-clip only: negative-advantage tokens lose at most -c A (None: off).
      tbpo_dual_clip: c of TBPO's two-sided clipping of negative-advantage sequences.
      tbpo_band: (b_lo, b_hi), TBPO drops sequences whose ratio s_i leaves this trust band.
      loss_aggregation: "token_mean" (over all response tokens of the mini-batch) or "seq_mean"
        (over sequences of their token means).
      learning_rate: eta, the peak learning rate of AdamW.
      warmup_steps: linear warmup from 0 to eta (optimizer steps).
      min_lr_ratio: the cosine decay ends at min_lr_ratio * eta.
      weight_decay: lambda, AdamW's decoupled weight decay (on matrices only, ndim >= 2).
      adam_b1, adam_b2, adam_eps: beta_1, beta_2, epsilon of Adam.
      grad_clip_norm: the global gradient norm is clipped to this (None: no clipping).
      mini_batches: M, optimizer steps per rollout batch (the batch is split M ways).
      max_staleness: the most policy versions between the policy that sampled a sequence and
        the one that is trained on it (the paper: 3); the m-th mini-batch of a rollout batch is
        m versions stale, so M - 1 <= max_staleness.
      routing_replay: R3, the trainer reuses the rollout's expert choices.
    """

    group_size: int = 8
    advantage: str = "grpo"
    adv_eps: float = 1e-6
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    is_cap: float | None = 5.0
    beta: float = 0.0
    dual_clip: float | None = None
    tbpo_dual_clip: float = 3.0
    tbpo_band: tuple[float, float] = (0.2, 5.0)
    loss_aggregation: str = "token_mean"
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip_norm: float | None = 1.0
    mini_batches: int = 1
    max_staleness: int = 3
    routing_replay: bool = True

    def __post_init__(self):
        c = Checks("GRPOConfig")
        c.ints(self, ("group_size",), 2)
        c.ints(self, ("mini_batches",), 1)
        c.ints(self, ("warmup_steps", "max_staleness"), 0)
        c.one_of(self, "advantage", ADVANTAGES)
        c.one_of(self, "loss_aggregation", AGGREGATIONS)
        c.number(self, "adv_eps", ">= 0", lambda x: x >= 0)
        c.number(self, "clip_eps_low", "in (0, 1)", lambda x: 0 < x < 1)
        c.number(self, "clip_eps_high", "> 0", lambda x: x > 0)
        c.number(self, "is_cap", ">= 1", lambda x: x >= 1, optional=True)
        c.number(self, "beta", ">= 0", lambda x: x >= 0)
        c.number(self, "dual_clip", "> 1", lambda x: x > 1, optional=True)
        c.number(self, "tbpo_dual_clip", "> 1", lambda x: x > 1)
        c.number(self, "learning_rate", "> 0", lambda x: x > 0)
        c.number(self, "min_lr_ratio", "in [0, 1]", lambda x: 0 <= x <= 1)
        c.number(self, "weight_decay", ">= 0", lambda x: x >= 0)
        c.number(self, "adam_b1", "in [0, 1)", lambda x: 0 <= x < 1)
        c.number(self, "adam_b2", "in [0, 1)", lambda x: 0 <= x < 1)
        c.number(self, "adam_eps", "> 0", lambda x: x > 0)
        c.number(self, "grad_clip_norm", "> 0", lambda x: x > 0, optional=True)
        band = tuple(self.tbpo_band)
        c.need(
            len(band) == 2 and all(map(finite_number, band)) and 0 <= band[0] < 1 < band[1],
            "tbpo_band",
            f"must be (b_lo, b_hi) with 0 <= b_lo < 1 < b_hi, got {self.tbpo_band}",
        )
        if not c.problems:  # the counts are ints: compare them
            c.need(
                self.mini_batches - 1 <= self.max_staleness,
                ("mini_batches", "max_staleness"),
                f"disagree: mini-batch m trains m versions stale, so the last of "
                f"{self.mini_batches} is {self.mini_batches - 1} > {self.max_staleness}",
            )
        c.raise_any()
        object.__setattr__(self, "tbpo_band", (float(band[0]), float(band[1])))

    def loss_kwargs(self, loss: str) -> dict:
        """The keyword hyper-parameters of the loss `loss` ("ppo_clip" or "tbpo") in this config."""
        common = {
            "clip_eps_low": self.clip_eps_low,
            "clip_eps_high": self.clip_eps_high,
            "is_cap": self.is_cap,
            "beta": self.beta,
            "aggregation": self.loss_aggregation,
        }
        if loss == "ppo_clip":
            return common | {"dual_clip": self.dual_clip}
        if loss == "tbpo":
            return common | {"dual_clip": self.tbpo_dual_clip, "band": self.tbpo_band}
        raise ValueError(f"unknown loss {loss!r}; expected 'ppo_clip' or 'tbpo'")


def make_schedule(cfg: GRPOConfig, total_steps: int | None = None) -> optax.Schedule:
    """Linear warmup to `cfg.learning_rate`, then cosine decay to `min_lr_ratio` of it.

    `total_steps` counts optimizer steps (RL steps x mini-batches), warmup included; None keeps
    the rate constant after the warmup.
    """
    peak = cfg.learning_rate
    if total_steps is None:
        if cfg.warmup_steps == 0:
            return optax.constant_schedule(peak)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, cfg.warmup_steps), optax.constant_schedule(peak)],
            [cfg.warmup_steps],
        )
    if total_steps <= cfg.warmup_steps:
        raise ValueError(f"total_steps={total_steps} must exceed warmup_steps={cfg.warmup_steps}")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=cfg.warmup_steps,
        decay_steps=total_steps,
        end_value=peak * cfg.min_lr_ratio,
    )


def _decay_mask(params):
    """Weight decay on matrices and larger (not on norms' scales or biases)."""
    return jax.tree.map(lambda p: jax.numpy.ndim(p) >= 2, params)


@functools.lru_cache(maxsize=64)
def make_optimizer(cfg: GRPOConfig, total_steps: int | None = None) -> optax.GradientTransformation:
    """AdamW on `make_schedule(cfg, total_steps)`, after global-norm gradient clipping.

    Cached: the transformation is static metadata of `nnx.Optimizer`'s graph, so a new (equal but
    not identical) object per run would make every jitted train step retrace and recompile in
    each resumed chunk or table run of the same settings (minutes on the GPU).
    """
    adamw = optax.adamw(
        make_schedule(cfg, total_steps),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=_decay_mask,
    )
    if cfg.grad_clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
