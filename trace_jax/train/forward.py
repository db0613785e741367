"""Teacher-forced training forward over rollout sequences, in modes off / rtn / guided.

It runs the whole prompt + response in one pass (a genuinely different execution path from the
rollout's token-by-token decode over a quantized KV cache) and reports per-token log-probs of the
rollout's tokens, plus, when asked, per-site code mismatch against the rollout's full codes.

Axis legend: B batch, S slots, L layers, K top-k, V vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from trace_jax.fp4 import Guidance
from trace_jax.models import Qwen3MoE
from trace_jax.quant import QuantConfig, QuantSites, SiteMode
from trace_jax.rollout import Rollout, policy_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainForward:
    """Outputs of one training forward.

    logprobs: float32 [B, S], log-prob of `rollout.tokens[b, s]` at response slots (0 elsewhere).
    expert_choices: int32 [L, B, S, K], the experts the trainer used.
    router_aux_loss: float32 scalar.
    router_agreement: float32 scalar, the mean over processed tokens and layers of the fraction of
      the rollout's top-k experts that the trainer's own router also ranks in its top-k (1 when
      they agree; measured whether or not routing is replayed).
    stats: site key -> code-mismatch statistics against the reference codes (if given).
    coverage: site key -> {"rows", "guided_rows"} counts (guided mode): rows without guidance
      fell back to round-to-nearest.
    """

    logprobs: jax.Array
    expert_choices: jax.Array
    router_aux_loss: jax.Array
    router_agreement: jax.Array
    stats: dict[str, dict[str, jax.Array]]
    coverage: dict[str, dict[str, jax.Array]]


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
    """float32 [B, S]: log-prob of `tokens[b, s]` from `logits[b, s - 1]` (0 at s = 0)."""
    lp = policy_logprobs(logits[:, :-1], temperature)
    picked = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


def router_agreement(probs: jax.Array, rollout_experts: jax.Array, processed: jax.Array):
    """Mean fraction of the rollout's experts `[L, B, T, K]` among the top-k of the trainer's
    router probabilities `[L, B, T, E]`, over the tokens where `processed [B, T]` is True."""
    own = jax.lax.top_k(jax.lax.stop_gradient(probs), rollout_experts.shape[-1])[1]
    same = (own[..., :, None] == rollout_experts[..., None, :]).any(-1).mean(-1)  # [L, B, T]
    m = jnp.broadcast_to(processed, same.shape)
    return jnp.sum(jnp.where(m, same, 0.0)) / jnp.maximum(jnp.sum(m), 1)


def train_forward(
    model: Qwen3MoE,
    rollout: Rollout,
    *,
    qcfg: QuantConfig,
    mode: str | SiteMode,
    replay: bool = False,
    guidance: Mapping[str, Guidance] | None = None,
    reference: Mapping[str, Guidance] | None = None,
    temperature: float = 1.0,
) -> TrainForward:
    """Teacher-forced forward of `rollout.tokens` with the FP4 recipe `qcfg`.

    Args:
      model: the policy (the same weights the rollout used, or newer ones).
      rollout: the batch to score.
      mode: OFF (bf16), RTN (vanilla FP4 QAT: own scales, round to nearest) or GUIDED (the
        rollout's guidance at `qcfg`'s guided layers, RTN elsewhere).
      replay: routing replay (R3): reuse the rollout's expert choices.
      guidance: overrides `rollout.guidance` (e.g. compact guidance derived from full).
      reference: full rollout codes per site key, for mismatch statistics.
      temperature: the rollout's sampling temperature (log-probs are taken at it).
    """
    mode = SiteMode(mode)
    valid = jnp.arange(rollout.tokens.shape[1])[None, :] < rollout.lengths[:, None]
    sites = QuantSites(
        qcfg,
        model.cfg.n_layers,
        mode,
        guidance=rollout.guidance if guidance is None else guidance,
        rollout_experts=rollout.expert_choices,
        reference=reference,
        valid=rollout.processed,
        differentiable=True,
    )
    logits, aux = model(
        rollout.tokens,
        mask=valid,
        site=sites,
        expert_choices=rollout.expert_choices if replay else None,
    )
    lp = token_logprobs(logits, rollout.tokens, temperature)
    return TrainForward(
        logprobs=jnp.where(rollout.response_mask, lp, 0.0),
        expert_choices=aux["topk_idx"],
        router_aux_loss=aux["router_aux_loss"],
        router_agreement=router_agreement(
            aux["router_probs"], rollout.expert_choices, rollout.processed
        ),
        stats=sites.stats,
        coverage=sites.coverage,
    )
