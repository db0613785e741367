"""Which layers to guide, per byte of guidance: several guided-layer sets scored on one rollout.

Each policy samples one FP4 W/A/KV rollout with full codes captured at every quantized site
(`trace_jax.tables.gap.sample_pair`); the teacher-forced training forward then scores that same
rollout once per guided-layer set (`layer_sets`: none, the deeper half, the shallower half, the
odd layers, all layers), with compact guidance at the set's layers and RTN elsewhere. Per set:
guidance bytes per token, the log-prob gap and KL against the rollout, and the code mismatch over
every quantized site (guided and unguided), split by layer; the BF16 pair is the floor.

The policies: a random init at each model depth on random prompts, and trained policies (an SFT
checkpoint, an RL run's final step: `load_trained_policy`) on the config's task prompts, each
checked against the study's model (depth, then every shape) before anything is sampled.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from trace_jax import fp4
from trace_jax.models import Qwen3MoE, init_model
from trace_jax.quant import SiteMode, quant_recipe, resolve_layers
from trace_jax.quant.config import parse_site_key
from trace_jax.rl.checkpoint import checkpoint_manager
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables.gap import (
    GapConfig,
    RolloutPair,
    guidance_bytes_per_token,
    pooled_mismatch,
    sample_pair,
    score_fp4_rollout,
)
from trace_jax.tables.ptq_table import load_policy

BF16_PAIR = "bf16 pair"  # the `layer_set` of each policy's reference row
NO_LAYERS = "none (rtn)"
RANDOM_INIT = "random init"  # the `policy` of the random-init rows


def layer_sets(n_layers: int) -> dict[str, tuple[int, ...]]:
    """The guided-layer sets of an `n_layers` model, by name: none (the trainer's own RTN), the
    deeper half (`resolve_layers("half")`, the paper's setting), the shallower half (the other
    layers), the odd layers (every other one, the last of an even depth included), all layers."""
    deeper = resolve_layers("half", n_layers)
    return {
        NO_LAYERS: (),
        "deeper half": deeper,
        "shallower half": tuple(range(n_layers - len(deeper))),
        "odd layers": tuple(range(1, n_layers, 2)),
        "all layers": tuple(range(n_layers)),
    }


@dataclasses.dataclass(frozen=True)
class LayerStudyResult:
    """rows: one per (policy, depth, layer set), each policy's BF16 pair first: `policy` (its
    label: `RANDOM_INIT` or a checkpoint's), `n_layers`, `layer_set`, `guided_layers`,
    `guidance_bytes_per_token`, `gap_metrics`, `gap_over_bf16`, `router_agreement` (the share of
    the rollout's experts the trainer's own router ranks top-k), `code_mismatch` over all
    quantized sites and split into `_guided` / `_unguided`. per_layer: the code mismatch of every
    layer pooled over its sites, per (policy, depth, set). policies: one dict per policy studied,
    `policy`, `n_layers` and `sampled` (what sampled, in words). replay: whether the trainer
    replayed the rollout's routing."""

    rows: list[dict]
    per_layer: list[dict]
    policies: list[dict]
    replay: bool


def score_layer_sets(
    pair: RolloutPair, config: ExperimentConfig, sets: Mapping[str, Sequence[int]]
) -> tuple[list[dict], list[dict]]:
    """(rows, per_layer) of `pair`'s FP4 rollout scored once per guided-layer set of `sets`
    (an empty set is the RTN trainer), compact guidance at the set's layers, routing replay as
    `config.rl.grpo.routing_replay` says; rows open with the BF16 pair."""
    n_layers, rl = config.model.n_layers, config.rl
    base = quant_recipe(rl.format)
    all_keys = base.all_keys(n_layers)
    keys_of_layer = {i: [k for k in all_keys if parse_site_key(k)[0] == i] for i in range(n_layers)}
    compact = {k: fp4.to_compact(pair.fp4.guidance[k]) for k in all_keys}
    bf16_gap = pair.bf16_pair["logp_gap_mean"]
    rows = [
        {"n_layers": n_layers, "layer_set": BF16_PAIR, "guided_layers": [], **pair.bf16_pair,
         "gap_over_bf16": 1.0, "guidance_bytes_per_token": 0.0}
    ]  # fmt: skip
    per_layer = []
    for name, layers in sets.items():
        layers = resolve_layers(tuple(layers), n_layers)
        # RTN ignores the guided layers: the recipe's own config shares its compiled forward.
        qcfg = quant_recipe(rl.format, guided_layers=layers) if layers else base
        guided = qcfg.guided_keys(n_layers) if layers else ()
        guidance = {k: compact[k] for k in guided}
        out, metrics = score_fp4_rollout(
            pair,
            qcfg,
            SiteMode.GUIDED if layers else SiteMode.RTN,
            replay=rl.grpo.routing_replay,
            guidance=guidance or None,
            temperature=rl.temperature,
        )
        unguided = [k for k in all_keys if k not in set(guided)]
        rows.append(
            {
                "n_layers": n_layers,
                "layer_set": name,
                "guided_layers": list(layers),
                **metrics,
                # The trainer's own router, replayed or not (replay makes the used choices agree).
                "router_agreement": float(out.router_agreement),
                "gap_over_bf16": metrics["logp_gap_mean"] / bf16_gap if bf16_gap else math.nan,
                "guidance_bytes_per_token": guidance_bytes_per_token(guidance, pair.fp4),
                "code_mismatch": pooled_mismatch(out.stats, all_keys)["code_mismatch"],
                "code_mismatch_guided": pooled_mismatch(out.stats, guided)["code_mismatch"],
                "code_mismatch_unguided": pooled_mismatch(out.stats, unguided)["code_mismatch"],
            }
        )
        per_layer += [
            {"n_layers": n_layers, "layer_set": name, "layer": i, "guided": i in layers,
             "code_mismatch": pooled_mismatch(out.stats, keys)["code_mismatch"]}
            for i, keys in keys_of_layer.items()
        ]  # fmt: skip
    return rows, per_layer


def measure_layer_sets(
    config: ExperimentConfig,
    gap: GapConfig,
    sets: Mapping[str, Sequence[int]] | None = None,
    model: Qwen3MoE | None = None,
) -> tuple[list[dict], list[dict], str]:
    """(rows, per_layer, policy): one rollout pair of `config`'s policy (`sample_pair`; `model`:
    the trained policy `rl.init_from` names, already loaded) scored for each set of `sets`
    (default `layer_sets(config.model.n_layers)`; `score_layer_sets`)."""
    sets = layer_sets(config.model.n_layers) if sets is None else sets
    pair = sample_pair(config, gap, quant_recipe(config.rl.format), model)
    return (*score_layer_sets(pair, config, sets), pair.policy)


def _param_shapes(tree: Mapping, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """{"layers.0.moe.w_up": shape} of a nested mapping of arrays or orbax array metadata (the
    `value` level of an `nnx.Variable` left out)."""
    out = {}
    for key, value in tree.items():
        name = prefix if key == "value" else f"{prefix}.{key}".lstrip(".")
        if isinstance(value, Mapping):
            out |= _param_shapes(value, name)
        else:
            out[name] = tuple(value.shape)
    return out


def saved_param_shapes(path: str) -> tuple[dict[str, tuple[int, ...]], int | None]:
    """(parameter name -> shape, step) of the policy saved at `path`: a `save_params` directory
    (an SFT checkpoint; step None) or an RL run's workdir (its newest step), read from the
    checkpoint's metadata alone. FileNotFoundError when `path` holds neither."""
    steps = os.path.join(path, "rl_checkpoints")
    if os.path.isdir(steps):
        manager = checkpoint_manager(steps, 1)
        step = manager.latest_step()
        manager.close()
        if step is None:
            raise FileNotFoundError(f"trained policy {path}: an RL workdir with no checkpoint")
        # The manager keeps a step's state as its item "default": {"model", "opt"}.
        where, subtree = os.path.join(steps, str(step), "default"), "model"
    elif os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA")):
        where, subtree, step = path, None, None
    else:
        raise FileNotFoundError(
            f"trained policy {path}: no saved parameters (an SFT checkpoint) or RL workdir "
            "(with rl_checkpoints/) there"
        )
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(os.path.abspath(where))).tree
    return _param_shapes(tree[subtree] if subtree else tree), step


def check_trained_policy(config: ExperimentConfig, path: str) -> None:
    """Checks that the policy saved at `path` (`saved_param_shapes`) fits `config.model`: its
    decoder-block count first, then every parameter's shape; and that an RL run finished
    `config.rl.steps` steps (`load_trained_policy` takes its final step). ValueError naming the
    first misfit."""
    saved, step = saved_param_shapes(path)
    what = "saved parameters" if step is None else f"RL step {step}"
    abstract = nnx.eval_shape(lambda: init_model(config.model, seed=config.seed))
    expected = _param_shapes(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    blocks = {name.split(".")[1] for name in saved if name.startswith("layers.")}
    if len(blocks) != config.model.n_layers:
        raise ValueError(
            f"trained policy {path} ({what}) has {len(blocks)} decoder blocks; the study's "
            f"model has model.n_layers={config.model.n_layers}: set it to {len(blocks)}"
        )
    for name in sorted(set(saved) | set(expected)):
        if saved.get(name) != expected.get(name):
            raise ValueError(
                f"trained policy {path} ({what}) does not fit the study's model (model.preset "
                f"and widths): {name} is {saved.get(name)} there, {expected.get(name)} in the "
                "model"
            )
    if step is not None and step != config.rl.steps - 1:
        raise ValueError(
            f"trained policy {path}: its newest checkpoint is step {step}, not the final step "
            f"of rl.steps={config.rl.steps}: set rl.steps={step + 1} (the run's own) or finish "
            "the run"
        )


def load_trained_policy(config: ExperimentConfig, path: str) -> Qwen3MoE:
    """The policy saved at `path` as `config.model` (`check_trained_policy`, then
    `trace_jax.tables.ptq_table.load_policy`: an RL workdir must have finished `config.rl.steps`
    steps)."""
    check_trained_policy(config, path)
    return load_policy(config, path)


def guided_layer_study(
    config: ExperimentConfig,
    gap: GapConfig,
    depths: Sequence[int] = (),
    checkpoints: Sequence[tuple[str, str]] = (),
) -> LayerStudyResult:
    """`measure_layer_sets` with the default sets for a random init at each model depth of
    `depths` (the same preset, widths and seed; empty: `config.model.n_layers` alone) on random
    prompts, then for each trained policy of `checkpoints`, `(label, path)` pairs
    (`load_trained_policy`), as `config.model` on task prompts of `config.tasks`.

    Raises ValueError (before any sampling) when `config.rl.init_from` is set (`checkpoints`
    names the trained policies), a label repeats or is `RANDOM_INIT`, or a checkpoint does not
    fit `config.model` (`check_trained_policy`); FileNotFoundError when a path holds none.
    """
    if config.rl.init_from:
        raise ValueError(
            f"rl.init_from={config.rl.init_from!r}: the study names its trained policies in "
            "`checkpoints` ((label, path) pairs); leave rl.init_from empty"
        )
    labels = [label for label, _ in checkpoints]
    if len(set(labels)) != len(labels) or RANDOM_INIT in labels:
        raise ValueError(f"checkpoint labels {labels} must be distinct and not {RANDOM_INIT!r}")
    for _, path in checkpoints:
        check_trained_policy(config, path)
    rows, per_layer, policies = [], [], []

    def add(label: str, measured: tuple[list[dict], list[dict], str], n_layers: int) -> None:
        r, p, sampled = measured
        rows.extend({"policy": label, **x} for x in r)
        per_layer.extend({"policy": label, **x} for x in p)
        policies.append({"policy": label, "n_layers": n_layers, "sampled": sampled})

    for n_layers in depths or (config.model.n_layers,):
        model = dataclasses.replace(config.model, n_layers=n_layers)
        measured = measure_layer_sets(dataclasses.replace(config, model=model), gap)
        add(RANDOM_INIT, measured, n_layers)
    for label, path in checkpoints:
        trained = dataclasses.replace(config, rl=dataclasses.replace(config.rl, init_from=path))
        measured = measure_layer_sets(trained, gap, model=load_trained_policy(config, path))
        add(label, measured, config.model.n_layers)
    return LayerStudyResult(rows, per_layer, policies, config.rl.grpo.routing_replay)
