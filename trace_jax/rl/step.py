"""Jitted training steps: supervised warm start (SFT) and the GRPO policy update of any method.

Both steps take an NNX model and an `nnx.Optimizer`, update them in place (donated under
`nnx.jit`) and return a metrics dict. The GRPO step runs the method's trainer forward
(`trace_jax.train.train_forward`: off / rtn / guided, routing replay) on a rollout batch and its
loss (`trace_jax.rl.losses`), plus the router load-balancing loss.

Axis legend: B sequences, S slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.models import Qwen3MoE
from trace_jax.rl.config import GRPOConfig
from trace_jax.rl.losses import logprob_gap_metrics
from trace_jax.rl.methods import MethodSetup, bind_loss
from trace_jax.rollout import Rollout
from trace_jax.train import train_forward
from trace_jax.train.forward import token_logprobs


def sft_loss(model: Qwen3MoE, tokens: jax.Array, lengths: jax.Array, target_mask: jax.Array):
    """Mean next-token cross-entropy over `target_mask [B, S]` slots (bf16 model, no FP4)."""
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    logits, aux = model(tokens, mask=valid)
    lp = token_logprobs(logits, tokens, 1.0)
    n = jnp.maximum(jnp.sum(target_mask), 1)
    nll = -jnp.sum(jnp.where(target_mask, lp, 0.0)) / n
    loss = nll + model.cfg.router_aux_loss_coef * aux["router_aux_loss"]
    return loss, {"sft_nll": nll, "router_aux_loss": aux["router_aux_loss"]}


@nnx.jit(donate_argnames=("model", "optimizer"))
def sft_step(model, optimizer, tokens, lengths, target_mask):
    """One optimizer step on the SFT loss; returns metrics (loss, nll, grad norm)."""
    (loss, metrics), grads = nnx.value_and_grad(sft_loss, has_aux=True)(
        model, tokens, lengths, target_mask
    )
    optimizer.update(model, grads)
    return {"loss": loss, **metrics, "grad_norm": _global_norm(grads)}


def _global_norm(tree) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def trainer_logprobs(
    model: Qwen3MoE,
    rollout: Rollout,
    *,
    setup: MethodSetup,
    grpo: GRPOConfig,
    temperature: float,
    reference=None,
):
    """The trainer's forward of the method: `TrainForward` (log-probs [B, S], stats, coverage);
    `reference` (full rollout codes per site) adds code-mismatch statistics."""
    return train_forward(
        model,
        rollout,
        qcfg=setup.trainer_qcfg,
        mode=setup.trainer_mode,
        replay=grpo.routing_replay,
        temperature=temperature,
        reference=reference,
    )


@functools.partial(nnx.jit, static_argnames=("setup", "grpo", "temperature"))
def old_logprobs(model, rollout, *, setup: MethodSetup, grpo: GRPOConfig, temperature: float):
    """float32 [B, S]: the trainer's log-probs before the update (PPO's pi_old), no gradient."""
    out = trainer_logprobs(model, rollout, setup=setup, grpo=grpo, temperature=temperature)
    return jax.lax.stop_gradient(out.logprobs)


@functools.partial(nnx.jit, static_argnames=("setup", "grpo", "temperature"))
def site_mismatch(
    model, rollout, reference, *, setup: MethodSetup, grpo: GRPOConfig, temperature: float
):
    """Per site key, the trainer's code mismatch against the rollout's full codes `reference`
    (`trace_jax.fp4.mismatch_stats`), in the method's own trainer forward (guided or not)."""
    out = trainer_logprobs(
        model, rollout, setup=setup, grpo=grpo, temperature=temperature, reference=reference
    )
    return out.stats


def policy_loss(
    model: Qwen3MoE,
    rollout: Rollout,
    advantages: jax.Array,
    logp_old: jax.Array,
    *,
    setup: MethodSetup,
    grpo: GRPOConfig,
    temperature: float,
):
    """The method's loss on one rollout batch; returns (loss, metrics)."""
    out = trainer_logprobs(model, rollout, setup=setup, grpo=grpo, temperature=temperature)
    loss_fn = bind_loss(setup.loss, grpo)
    loss, metrics = loss_fn(
        out.logprobs,
        logp_old=logp_old,
        logp_rollout=rollout.logprobs,
        advantages=advantages,
        mask=rollout.response_mask,
    )
    loss = loss + model.cfg.router_aux_loss_coef * out.router_aux_loss
    gap = logprob_gap_metrics(
        jax.lax.stop_gradient(out.logprobs), rollout.logprobs, rollout.response_mask
    )
    rows = sum((c["rows"] for c in out.coverage.values()), jnp.int32(0))
    guided = sum((c["guided_rows"] for c in out.coverage.values()), jnp.int32(0))
    return loss, {
        **metrics,
        **{f"train_rollout_{k}": v for k, v in gap.items()},
        "router_aux_loss": out.router_aux_loss,
        "router_agreement": out.router_agreement,
        "guidance_rtn_fallback_rows": rows - guided,
    }


@functools.partial(
    nnx.jit,
    static_argnames=("setup", "grpo", "temperature"),
    donate_argnames=("model", "optimizer"),
)
def grpo_step(
    model,
    optimizer,
    rollout: Rollout,
    advantages: jax.Array,
    logp_old: jax.Array,
    *,
    setup: MethodSetup,
    grpo: GRPOConfig,
    temperature: float,
):
    """One optimizer step of the method's policy loss; returns metrics (incl. the gap metrics)."""
    loss_fn = functools.partial(policy_loss, setup=setup, grpo=grpo, temperature=temperature)
    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
        model, rollout, advantages, logp_old
    )
    optimizer.update(model, grads)
    return {"loss": loss, **metrics, "grad_norm": _global_norm(grads)}
