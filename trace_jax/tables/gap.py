"""The train-rollout gap, measured: FP4 rollout vs the teacher-forced training forward per mode.

Samples with an FP4 W/A/KV rollout (token-by-token decode over a packed FP4 KV cache, recording
full codes at every site for diagnostics), then recomputes the log-probs of the sampled tokens
with the training forward (one teacher-forced pass over prompt + response) in each mode: `rtn`
(vanilla FP4 QAT), `guided` with full and with compact guidance (at the guided layers), each
with and without routing replay; `off` on a BF16 rollout is the reference pair.

The experiment config says the policy (`model`, `seed`; `rl.init_from`: a trained policy, e.g.
the SFT warm start, on task prompts of `tasks.levels`, instead of a random one on random
prompts), the recipe (`rl.format`, `rl.guided_layers`) and the sampling (`rl.max_new_tokens`,
`rl.temperature`); the `gap` section (`GapConfig`) the batch. `sample_pair` and
`score_fp4_rollout` are the two halves, for studies that score one rollout many ways
(`trace_jax.tables.layer_study`).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import fp4, tasks
from trace_jax.models import Qwen3MoE, init_model
from trace_jax.quant import QuantConfig, SiteMode, quant_recipe
from trace_jax.quant.config import GUIDABLE_SITES
from trace_jax.rl.checkpoint import load_params
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rollout import Rollout, SamplingConfig, generate
from trace_jax.train import TrainForward, train_forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class GapConfig:
    """The `gap` section: `batch` sequences with prompts of up to `prompt_len` tokens (random
    prompts: lengths between half of it and all of it)."""

    batch: int = 8
    prompt_len: int = 16

    def __post_init__(self):
        if self.batch < 1 or self.prompt_len < 2:
            raise ValueError(f"gap: batch={self.batch} >= 1, prompt_len={self.prompt_len} >= 2")


@dataclasses.dataclass(frozen=True)
class GapResult:
    """rows: one per (mode, replay) (`gap_metrics`, code mismatch at the guided sites, router
    agreement, guidance bytes per token); per_site: the code mismatch of every site per
    (mode, replay); guided_layers: the layers with guidance; policy: what sampled, in words."""

    rows: list[dict]
    per_site: list[dict]
    guided_layers: tuple[int, ...]
    policy: str


def gap_metrics(lp_train, lp_roll, mask) -> dict[str, float]:
    """Mean / max |logp gap| per response token (`mask`) and KL(rollout || train) per token (k3
    estimator on the samples); log-probs float [B, S], mask bool [B, S]."""
    m = np.asarray(mask)
    d = (np.asarray(lp_train, np.float64) - np.asarray(lp_roll, np.float64))[m]
    kl = np.exp(d) - 1.0 - d  # unbiased, non-negative estimate of KL(rollout || train)
    return {
        "logp_gap_mean": float(np.mean(np.abs(d))),
        "logp_gap_max": float(np.max(np.abs(d))),
        "kl": float(np.mean(kl)),
    }


def router_agreement(train_experts, roll_experts, processed) -> float:
    """Mean fraction of the rollout's top-k experts the trainer also picked, per processed token;
    experts int [L, B, S, K], processed bool broadcastable to [L, B, S]."""
    t = np.asarray(train_experts)
    r = np.asarray(roll_experts)
    same = (t[..., :, None] == r[..., None, :]).any(-1).mean(-1)  # [L, B, S]
    m = np.broadcast_to(np.asarray(processed), same.shape)
    return float(same[m].mean())


def _prompts(config: ExperimentConfig, gap: GapConfig, model, k_prompt, k_len, *, load=True):
    """(prompts int32 [B, P], lengths int32 [B], sampling, policy in words); `load`: read
    `rl.init_from`'s parameters into `model` (False: the caller did)."""
    rl, b, p = config.rl, gap.batch, gap.prompt_len
    if rl.init_from:  # a trained policy on task prompts, stopping at EOS
        if load:
            load_params(model, rl.init_from)
        kinds, levels = config.tasks.kinds, config.tasks.levels
        stream = tasks.train_stream(config.seed, tasks=kinds, levels=levels)
        problems = list(itertools.islice(stream, b))
        prompts, lengths = map(jnp.asarray, tasks.encode_prompts(problems, pad_to=p))
        sampling = SamplingConfig(
            max_new_tokens=rl.max_new_tokens,
            temperature=rl.temperature,
            stop_tokens=(tasks.EOS_ID,),
            pad_id=tasks.PAD_ID,
        )
        policy = f"trained policy `{rl.init_from}`, task prompts (levels {list(levels)}, seed "
        return prompts, lengths, sampling, policy + f"{config.seed})"
    prompts = jax.random.randint(k_prompt, (b, p), 1, config.model.vocab_size, jnp.int32)
    lengths = jax.random.randint(k_len, (b,), max(1, p // 2), p + 1, jnp.int32)
    sampling = SamplingConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature)
    policy = f"random init (std {config.model.init_std}), prompts of {p // 2}-{p} random tokens"
    return prompts, lengths, sampling, policy


def pooled_mismatch(stats: dict, keys) -> dict[str, float]:
    """Code mismatch pooled over the sites `keys` of a forward's `stats` (elements counted, so
    wider sites weigh more) and the share of mismatches one adjacent code apart; NaN with no
    keys."""
    chosen = [stats[k] for k in keys]
    n_el = sum(int(s["n_elements"]) for s in chosen)
    n_mis = sum(int(s["n_mismatch"]) for s in chosen)
    n_one = sum(int(s["n_one_apart"]) for s in chosen)
    return {
        "code_mismatch": n_mis / n_el if n_el else float("nan"),
        "one_apart_fraction": n_one / n_mis if n_mis else float("nan"),
    }


# The teacher-forced forward, compiled once per recipe, mode and replay.
score = nnx.jit(train_forward, static_argnames=("qcfg", "mode", "replay", "temperature"))


@dataclasses.dataclass(frozen=True)
class RolloutPair:
    """One policy's two rollouts of one batch, from the same prompts and sampling key.

    model: the policy. fp4: the FP4 W/A/KV rollout; `fp4.guidance` holds full codes of every
    quantized site (the reference of every trainer mode's mismatch). bf16_pair: `gap_metrics`
    and router agreement of the bf16 forward against the BF16 rollout (the floor two bf16
    programs set). policy: what sampled, in words.
    """

    model: Qwen3MoE
    fp4: Rollout
    bf16_pair: dict[str, float]
    policy: str


def sample_pair(
    config: ExperimentConfig, gap: GapConfig, qcfg: QuantConfig, model: Qwen3MoE | None = None
) -> RolloutPair:
    """Samples the BF16 and the FP4 rollout of `config`'s policy (module docstring); the FP4
    rollout does not depend on `qcfg`'s guided layers, so one serves every guided-layer set.
    `model`: the policy `rl.init_from` names, already loaded (an RL run's checkpoint, say)."""
    n_layers = config.model.n_layers
    k_prompt, k_len, k_sample = jax.random.split(jax.random.key(config.seed), 3)
    loaded = model is not None
    model = model if loaded else init_model(config.model, seed=config.seed)
    prompts, lengths, sampling, policy = _prompts(
        config, gap, model, k_prompt, k_len, load=not loaded
    )
    graphdef, params = nnx.split(model)

    def rollout(mode, **capture):
        return generate(
            graphdef, params, prompts, lengths, k_sample, sampling=sampling, qcfg=qcfg, mode=mode,
            **capture,
        )  # fmt: skip

    roll_bf16 = rollout(SiteMode.OFF)
    temperature = config.rl.temperature
    off = score(model, roll_bf16, qcfg=qcfg, mode=SiteMode.OFF, temperature=temperature)
    bf16_pair = {
        **gap_metrics(off.logprobs, roll_bf16.logprobs, roll_bf16.response_mask),
        "router_agreement": router_agreement(
            off.expert_choices, roll_bf16.expert_choices, roll_bf16.processed
        ),
    }
    roll = rollout(
        SiteMode.RTN, capture=qcfg.all_keys(n_layers), capture_mode=fp4.GuidanceMode.FULL
    )
    return RolloutPair(model=model, fp4=roll, bf16_pair=bf16_pair, policy=policy)


def score_fp4_rollout(
    pair: RolloutPair,
    qcfg: QuantConfig,
    mode: SiteMode,
    *,
    replay: bool,
    guidance: dict[str, fp4.Guidance] | None,
    temperature: float,
) -> tuple[TrainForward, dict[str, float]]:
    """The training forward in `mode` on `pair.fp4`, and its `gap_metrics` and router agreement
    against that rollout (statistics in `.stats` for every quantized site)."""
    roll = pair.fp4
    out = score(
        pair.model, roll, qcfg=qcfg, mode=mode, replay=replay, guidance=guidance,
        reference=roll.guidance, temperature=temperature,
    )  # fmt: skip
    agreement = router_agreement(out.expert_choices, roll.expert_choices, roll.processed)
    metrics = gap_metrics(out.logprobs, roll.logprobs, roll.response_mask)
    return out, {**metrics, "router_agreement": agreement}


def guidance_bytes_per_token(guidance: dict[str, fp4.Guidance] | None, roll: Rollout) -> float:
    """Guidance bytes held per token slot of `roll` (its buffers' padding slots not counted)."""
    slots = roll.tokens.shape[0] * roll.tokens.shape[1]
    return sum(g.nbytes for g in guidance.values()) / slots if guidance else 0.0


def measure_gap(config: ExperimentConfig, gap: GapConfig) -> GapResult:
    """Measures the gap in every mode (module docstring)."""
    n_layers, rl = config.model.n_layers, config.rl
    # "" keeps the recipe's own guided layers (the deeper half).
    spec = {"guided_layers": rl.guided_layers} if rl.guided_layers else {}
    qcfg = quant_recipe(rl.format, **spec)
    guided_keys = qcfg.guided_keys(n_layers)
    pair = sample_pair(config, gap, qcfg)
    rows = [
        {
            "mode": "off (bf16 pair)",
            "replay": False,
            **pair.bf16_pair,
            "code_mismatch": float("nan"),
            "one_apart_fraction": float("nan"),
            "guidance_bytes_per_token": 0.0,
        }
    ]
    full = {k: pair.fp4.guidance[k] for k in guided_keys}
    compact = {k: fp4.to_compact(g) for k, g in full.items()}
    per_site = []
    for label, mode, guidance in [
        ("rtn", SiteMode.RTN, None),
        ("guided full", SiteMode.GUIDED, full),
        ("guided compact", SiteMode.GUIDED, compact),
    ]:
        for replay in (False, True):
            out, metrics = score_fp4_rollout(
                pair, qcfg, mode, replay=replay, guidance=guidance, temperature=rl.temperature
            )
            fallback = sum(int(c["rows"]) - int(c["guided_rows"]) for c in out.coverage.values())
            rows.append(
                {
                    "mode": label,
                    "replay": replay,
                    **metrics,
                    **pooled_mismatch(out.stats, guided_keys),
                    "guidance_bytes_per_token": guidance_bytes_per_token(guidance, pair.fp4),
                    "rtn_fallback_rows": fallback,
                }
            )
            per_site += [
                {"mode": label, "replay": replay, "layer": layer, "site": site,
                 "code_mismatch": float(out.stats[f"{layer}/{site}"]["mismatch"])}
                for layer in range(n_layers)
                for site in GUIDABLE_SITES
                if f"{layer}/{site}" in out.stats
            ]  # fmt: skip
    layers = qcfg.layers_guided(n_layers)
    return GapResult(rows=rows, per_site=per_site, guided_layers=layers, policy=pair.policy)
