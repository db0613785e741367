"""Held-out evaluation: pass@1 of a policy on the held-out sets, averaged over k samples.

suite = EvalSuite.from_config(config)          # the sets, tokenizer and verifier of a run
scores = pass_at_1_by_split(model, suite, keys)  # set name -> pass@1
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from trace_jax import data
from trace_jax.distributed import host_value, is_primary, process_rows, read_rows, rows_from_local
from trace_jax.models import Qwen3MoE, resolve_implementation
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rl.experiment import EvalConfig, ExperimentConfig
from trace_jax.rl.sharding import batch_spec, mesh_context
from trace_jax.rl.workers import batch_sharding
from trace_jax.rollout import SamplingConfig, generate

# `<set><BF16_SUFFIX>`: an FP4 method's policy scored in bf16 (`EvalConfig.in_bf16_too`).
BF16_SUFFIX = "@bf16"


@dataclasses.dataclass(frozen=True)
class EvalSuite:
    """A run's held-out evaluation, resolved from its config.

    config: the `eval` section (k, temperature, max_new_tokens). sets: set name -> its examples
    (the first `problems_per_split`). tokenizer, verifier: the run's (`tasks` section).
    """

    config: EvalConfig
    sets: Mapping[str, Sequence[data.Example]]
    tokenizer: data.Tokenizer
    verifier: data.Verifier

    @property
    def splits(self) -> tuple[str, ...]:
        """The set names, in evaluation order."""
        return tuple(self.sets)

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> EvalSuite:
        """The held-out sets of `config.eval` with the tokenizer and verifier of
        `config.tasks`. Raises ValueError when the tokenizer's ids do not fit the model, or the
        synthetic verifier would check examples from files."""
        if config.eval.files and config.tasks.verifier == "synthetic":
            raise ValueError(
                "eval.files need a verifier for examples from files: set tasks.verifier='math'"
            )
        tokenizer = config.tasks.make_tokenizer()
        data.check_vocab(tokenizer, config.model.vocab_size)
        ev = config.eval
        return cls(
            config=ev,
            sets=data.held_out_sets(
                ev.splits, ev.files, config.tasks.layout(), ev.problems_per_split
            ),
            tokenizer=tokenizer,
            verifier=config.tasks.make_verifier(),
        )


def evaluate_pass_at_1(
    model: Qwen3MoE,
    problems: Sequence[data.Example],
    key: jax.Array,
    *,
    tokenizer: data.Tokenizer,
    verifier: data.Verifier,
    k: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    qcfg: QuantConfig | None = None,
    mode: SiteMode = SiteMode.OFF,
    implementation: str = "auto",
    mesh: jax.sharding.Mesh | None = None,
) -> float:
    """Mean over examples of the mean reward (format weight 0: 1 when `verifier` accepts the
    answer, else 0) of `k` samples (greedy when T = 0).

    `qcfg`/`mode` choose the execution: SiteMode.OFF is bf16, SiteMode.RTN the FP4 policy;
    `implementation` the sampler's kernels ("auto": the Pallas kernels on a GPU or a TPU, XLA
    elsewhere; "pallas"; "xla": `trace_jax.models.resolve_implementation`). `mesh`: the one the
    model is placed on (None: one device). The samples' rows split like a rollout batch's when
    they divide evenly (every device samples all of them otherwise); every process calls this,
    samples and scores the rows its devices hold, and returns the same pass@1.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    repeated = [p for p in problems for _ in range(k)]
    n, sharding = len(repeated), eval_sharding(mesh, len(repeated))
    here = process_rows(sharding, n)
    longest = max(len(tokenizer.prompt_ids(p.question)) for p in problems)
    # Prompt widths bucketed to powers of two: the sets share a few compiled samplers.
    prompts, lengths = data.encode_prompts(
        repeated[here], pad_to=max(16, 1 << (longest - 1).bit_length()), tokenizer=tokenizer
    )
    prompts, lengths = rows_from_local((prompts, lengths), sharding, n)
    graphdef, params = nnx.split(model)
    sampling = SamplingConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        stop_tokens=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
    )
    with mesh_context(mesh):
        roll = generate(
            graphdef,
            params,
            prompts,
            lengths,
            key,
            sampling=sampling,
            qcfg=qcfg or QuantConfig.bf16(),
            mode=mode,
            implementation=resolve_implementation(implementation).value,
        )
    responses = data.responses_from_rollout(
        *(read_rows(x, here) for x in (roll.tokens, roll.prompt_lengths, roll.lengths))
    )
    rewards = data.compute_rewards(
        repeated[here], responses, tokenizer=tokenizer, verifier=verifier
    )
    rewards = host_value(rows_from_local(rewards, sharding, n))
    return float(data.pass_at_1(rewards.reshape(len(problems), k)))


def eval_sharding(mesh: jax.sharding.Mesh | None, n: int) -> NamedSharding | None:
    """Where `n` evaluation rows go: split like a rollout batch (`batch_sharding`) when they
    divide evenly, else replicated (every device samples every row)."""
    if mesh is None:
        return None
    (axes,) = batch_spec(mesh) or ((),)
    axes = axes if isinstance(axes, tuple) else (axes,)
    if n % math.prod(mesh.shape[a] for a in axes) == 0:
        return batch_sharding(mesh)
    return NamedSharding(mesh, P())


def pass_at_1_by_split(
    model: Qwen3MoE,
    suite: EvalSuite,
    keys: Sequence[jax.Array],
    *,
    qcfg: QuantConfig | None = None,
    mode: SiteMode = SiteMode.OFF,
    implementation: str = "auto",
    mesh: jax.sharding.Mesh | None = None,
) -> dict[str, float]:
    """Set name -> pass@1 (`evaluate_pass_at_1`, `implementation` and `mesh` as there) on
    each of `suite.sets`, set i sampled with `keys[i]`."""
    if len(keys) != len(suite.splits):
        raise ValueError(f"{len(keys)} PRNG keys for {len(suite.splits)} held-out sets")
    ev = suite.config
    sets = tqdm(
        zip(suite.splits, keys, strict=True),
        total=len(suite.splits),
        desc=f"eval ({'bf16' if mode is SiteMode.OFF else 'fp4'})",
        leave=False,
        disable=not is_primary(),
    )
    return {
        name: evaluate_pass_at_1(
            model,
            suite.sets[name],
            key,
            tokenizer=suite.tokenizer,
            verifier=suite.verifier,
            k=ev.k,
            max_new_tokens=ev.max_new_tokens,
            temperature=ev.temperature,
            qcfg=qcfg,
            mode=mode,
            implementation=implementation,
            mesh=mesh,
        )
        for name, key in sets
    }
