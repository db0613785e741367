"""Held-out evaluation: pass@1 of a policy on the task splits, averaged over k samples."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from trace_jax import tasks
from trace_jax.models import Qwen3MoE, resolve_implementation
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rl.experiment import EvalConfig
from trace_jax.rollout import SamplingConfig, generate


def evaluate_pass_at_1(
    model: Qwen3MoE,
    problems: Sequence[tasks.Problem],
    key: jax.Array,
    *,
    k: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    qcfg: QuantConfig | None = None,
    mode: SiteMode = SiteMode.OFF,
    implementation: str = "auto",
) -> float:
    """Mean over problems of the mean exact-answer reward of `k` samples (greedy when T = 0).

    `qcfg`/`mode` choose the execution: SiteMode.OFF is bf16, SiteMode.RTN the FP4 policy;
    `implementation` the sampler's kernels ("auto": the Pallas kernels on a GPU, XLA elsewhere;
    "pallas"; "xla": `trace_jax.models.resolve_implementation`).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    repeated = [p for p in problems for _ in range(k)]
    longest = max(len(tasks.prompt_ids(p)) for p in repeated)
    # Prompt widths bucketed to powers of two: the splits share a few compiled samplers.
    prompts, lengths = tasks.encode_prompts(
        repeated, pad_to=max(16, 1 << (longest - 1).bit_length())
    )
    graphdef, params = nnx.split(model)
    sampling = SamplingConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        stop_tokens=(tasks.EOS_ID,),
        pad_id=tasks.PAD_ID,
    )
    roll = generate(
        graphdef,
        params,
        jnp.asarray(prompts),
        jnp.asarray(lengths),
        key,
        sampling=sampling,
        qcfg=qcfg or QuantConfig.bf16(),
        mode=mode,
        implementation=resolve_implementation(implementation).value,
    )
    responses = tasks.responses_from_rollout(roll.tokens, roll.prompt_lengths, roll.lengths)
    rewards = tasks.batch_rewards(repeated, responses)
    return float(tasks.pass_at_1(np.asarray(rewards).reshape(len(problems), k)))


def pass_at_1_by_split(
    model: Qwen3MoE,
    config: EvalConfig,
    keys: Sequence[jax.Array],
    *,
    qcfg: QuantConfig | None = None,
    mode: SiteMode = SiteMode.OFF,
    implementation: str = "auto",
) -> dict[str, float]:
    """Split -> pass@1 (`evaluate_pass_at_1`, `implementation` as there) on the first
    `config.problems_per_split` problems of each of `config.splits`, split i sampled with
    `keys[i]`."""
    if len(keys) != len(config.splits):
        raise ValueError(f"{len(keys)} PRNG keys for {len(config.splits)} splits")
    splits = tqdm(
        zip(config.splits, keys, strict=True),
        total=len(config.splits),
        desc=f"eval ({'bf16' if mode is SiteMode.OFF else 'fp4'})",
        leave=False,
    )
    return {
        name: evaluate_pass_at_1(
            model,
            tasks.eval_split(name)[: config.problems_per_split],
            key,
            k=config.k,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            qcfg=qcfg,
            mode=mode,
            implementation=implementation,
        )
        for name, key in splits
    }
