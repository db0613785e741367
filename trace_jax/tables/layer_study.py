"""Which layers to guide, per byte of guidance: several guided-layer sets scored on one rollout.

For each model depth, one policy samples one FP4 W/A/KV rollout with full codes captured at every
quantized site (`trace_jax.tables.gap.sample_pair`); the teacher-forced training forward then
scores that same rollout once per guided-layer set (`layer_sets`: none, the deeper half, the
shallower half, the odd layers, all layers), with compact guidance at the set's layers and RTN
elsewhere. Per set: guidance bytes per token, the log-prob gap and KL against the rollout, and
the code mismatch over every quantized site (guided and unguided), split by layer; the BF16 pair
is the floor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from trace_jax import fp4
from trace_jax.quant import SiteMode, quant_recipe, resolve_layers
from trace_jax.quant.config import parse_site_key
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables.gap import (
    GapConfig,
    RolloutPair,
    guidance_bytes_per_token,
    pooled_mismatch,
    sample_pair,
    score_fp4_rollout,
)

BF16_PAIR = "bf16 pair"  # the `layer_set` of each depth's reference row
NO_LAYERS = "none (rtn)"


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
    """rows: one per (depth, layer set), each depth's BF16 pair first: `n_layers`, `layer_set`,
    `guided_layers`, `guidance_bytes_per_token`, `gap_metrics`, `gap_over_bf16`,
    `router_agreement` (the share of the rollout's experts the trainer's own router ranks top-k),
    `code_mismatch` over all quantized sites and split into `_guided` / `_unguided`. per_layer:
    the code mismatch of every layer pooled over its sites, per (depth, set). policies: depth ->
    what sampled, in words. replay: whether the trainer replayed the rollout's routing."""

    rows: list[dict]
    per_layer: list[dict]
    policies: dict[int, str]
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
    config: ExperimentConfig, gap: GapConfig, sets: Mapping[str, Sequence[int]] | None = None
) -> tuple[list[dict], list[dict], str]:
    """(rows, per_layer, policy): one rollout pair of `config`'s policy (`sample_pair`) scored
    for each set of `sets` (default `layer_sets(config.model.n_layers)`; `score_layer_sets`)."""
    sets = layer_sets(config.model.n_layers) if sets is None else sets
    pair = sample_pair(config, gap, quant_recipe(config.rl.format))
    return (*score_layer_sets(pair, config, sets), pair.policy)


def guided_layer_study(
    config: ExperimentConfig, gap: GapConfig, depths: Sequence[int] = ()
) -> LayerStudyResult:
    """`measure_layer_sets` with the default sets at each model depth of `depths` (the same
    preset, widths and seed; empty: `config.model.n_layers` alone)."""
    rows, per_layer, policies = [], [], {}
    for n_layers in depths or (config.model.n_layers,):
        model = dataclasses.replace(config.model, n_layers=n_layers)
        r, p, policies[n_layers] = measure_layer_sets(dataclasses.replace(config, model=model), gap)
        rows += r
        per_layer += p
    return LayerStudyResult(rows, per_layer, policies, config.rl.grpo.routing_replay)
