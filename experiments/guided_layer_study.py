r"""Which layers to guide, per byte of guidance, as the model gets deeper and as it trains.

  python -m experiments.guided_layer_study                           # tiny at 8, 16, 32 layers
  python -m experiments.guided_layer_study --config.depths=8 --config.gap.batch=16
  python -m experiments.guided_layer_study --config=configs/guided_layer_study.py:trained \
      --name=guided_layer_study_trained                # after its SFT and GRPO stages

Each policy (a random init at each depth, each trained checkpoint of `checkpoints`) samples one
FP4 rollout (full codes captured at every quantized site); the training forward scores it with
compact guidance on none, the deeper half, the shallower half, the odd layers and all layers
(`trace_jax.tables.layer_study`): guidance bytes per token, log-prob gap (and its ratio to the
BF16 pair's), KL, code mismatch over all quantized sites and per layer. The settings, and the
commands that train the checkpoints, are `configs/guided_layer_study.py`. Writes
`<outdir>/<name>.{md,json,png}` (the plot: per-layer mismatch per set for each policy, and the
gap against guidance bytes per token).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import matplotlib
from absl import app, flags

from experiments import harness
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.logs import quiet_third_party
from trace_jax.tables.gap import GapConfig
from trace_jax.tables.layer_study import (
    BF16_PAIR,
    RANDOM_INIT,
    LayerStudyResult,
    guided_layer_study,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLUMNS = (
    "policy", "n_layers", "layer_set", "guided", "guidance_bytes_per_token", "logp_gap_mean",
    "gap_over_bf16", "kl", "code_mismatch", "code_mismatch_guided", "code_mismatch_unguided",
    "router_agreement",
)  # fmt: skip


def layers_text(layers: Sequence[int]) -> str:
    """Layer indices in a few characters: "-", "4-7", "1,3,..,31", "0,2,5"."""
    if not layers:
        return "-"
    steps = {b - a for a, b in itertools.pairwise(layers)}
    if len(layers) > 1 and steps == {1}:
        return f"{layers[0]}-{layers[-1]}"
    if len(layers) > 3 and len(steps) == 1:
        return f"{layers[0]},{layers[1]},..,{layers[-1]}"
    return ",".join(map(str, layers))


def policy_name(policy: dict) -> str:
    """The name of an entry of `LayerStudyResult.policies`: its label and depth."""
    return f"{policy['policy']}, {policy['n_layers']} layers"


def plot(result: LayerStudyResult, path: str) -> None:
    """Per-layer code mismatch of each set, one panel per policy (guided layers marked by filled
    dots), and the log-prob gap over the BF16 pair's against guidance bytes per token."""
    panels = result.policies
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 3.6))
    sets = list(dict.fromkeys(r["layer_set"] for r in result.per_layer))
    colors = dict(zip(sets, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))

    def of(rows, policy):
        return [
            r for r in rows
            if (r["policy"], r["n_layers"]) == (policy["policy"], policy["n_layers"])
        ]  # fmt: skip

    for ax, policy in zip(axes, panels, strict=False):
        for name in sets:
            rs = [r for r in of(result.per_layer, policy) if r["layer_set"] == name]
            x = [r["layer"] for r in rs]
            y = [max(r["code_mismatch"], 1e-6) for r in rs]
            ax.plot(x, y, "-", color=colors[name], label=name, lw=1)
            gx = [(xi, yi) for xi, yi, r in zip(x, y, rs, strict=True) if r["guided"]]
            if gx:
                ax.plot(*zip(*gx, strict=True), "o", color=colors[name], ms=3)
        ax.set(title=policy_name(policy), xlabel="layer (dots: guided)", yscale="log")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("code mismatch vs rollout (0 at 1e-6)")
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for policy, marker in zip(panels, "os^vD<>", strict=False):
        rs = [r for r in of(result.rows, policy) if r["layer_set"] != BF16_PAIR]
        for r in rs:
            ax.plot(r["guidance_bytes_per_token"], r["gap_over_bf16"], marker,
                    color=colors[r["layer_set"]], ms=5, mfc="none")  # fmt: skip
        ax.plot([], [], marker, color="0.4", mfc="none", label=policy_name(policy))
    ax.legend(fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set(title="gap vs guidance (colour: set)", xlabel="guidance bytes / token",
           ylabel="logp gap / BF16 pair's")  # fmt: skip
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(
    config: ExperimentConfig, gap: GapConfig, result: LayerStudyResult, *, outdir: str, name: str
) -> dict[str, str]:
    """Writes `<outdir>/<name>.{md,json,png}` of a study; returns the md and json paths."""
    rl, m = config.rl, config.model
    widths = f"d_model {m.d_model}, {m.n_experts} experts (top {m.top_k}) of width {m.d_ff_expert}"
    policies = "; ".join(f"{policy_name(p)}: {p['sampled']}" for p in result.policies)
    trained = any(p["policy"] != RANDOM_INIT for p in result.policies)
    kind = (
        "Random policies on random prompts beside trained ones on task prompts (stopping at EOS)."
        if trained
        else "A random policy on random prompts, not a trained one."
    )
    notes = (
        f"Widths {widths}; {policies}; recipe `{rl.format}`, batch {gap.batch}, up "
        f"to {rl.max_new_tokens} new tokens at temperature {rl.temperature}, routing replay "
        f"{'on' if result.replay else 'off'}, compact guidance. {kind} Each policy scores one "
        "FP4 rollout with every layer set. "
        "`guided`: the guided layers. `guidance_bytes_per_token`: compact guidance held per "
        "token slot. `gap_over_bf16`: `logp_gap_mean` over the BF16 pair's. `code_mismatch`: "
        "fraction of the trainer's codes at all quantized sites that differ from the rollout's "
        "(expert_mid compared on slots whose expert both sides used); `_guided` / `_unguided`: "
        "the same over the guided / unguided layers' sites. `kl`: KL(rollout || train) per "
        f"response token, k3 estimator.\n\n![per-layer mismatch and gap per byte]({name}.png)"
    )
    shown = [{**r, "guided": layers_text(r["guided_layers"])} for r in result.rows]
    table = harness.markdown_table(shown, COLUMNS)
    paths = harness.write_results(
        name,
        result.rows,
        title="Which layers to guide: gap and code mismatch per guided-layer set and policy",
        table=table,
        notes=notes,
        outdir=outdir,
        extra={"per_layer": result.per_layer, "policies": result.policies},
    )
    plot(result, os.path.join(outdir, f"{name}.png"))
    print(table)
    return paths


def main(argv):
    del argv
    f = flags.FLAGS
    quiet_third_party(f.verbose)
    config = ExperimentConfig.from_config_dict(f.config)
    gap = from_section(GapConfig, f.config.gap)
    checkpoints = tuple((str(label), str(path)) for label, path in f.config.checkpoints)
    result = guided_layer_study(config, gap, tuple(f.config.depths), checkpoints)
    paths = write(config, gap, result, outdir=f.outdir, name=f.name)
    print(f"\nwrote {paths['md']} and {paths['json']}")


if __name__ == "__main__":
    harness.define_config_flag("guided_layer_study")
    harness.define_result_flags("guided_layer_study")
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl)")
    app.run(main)
