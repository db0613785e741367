r"""The train-rollout gap, measured: FP4 rollout vs teacher-forced training forward per mode.

  python -m experiments.train_rollout_gap                              # tiny, CPU, < 5 min
  python -m experiments.train_rollout_gap --config.model.preset=small --config.gap.batch=16 \
      --config.rl.max_new_tokens=256                                   # GPU
  python -m experiments.train_rollout_gap --config.rl.init_from=<sft_checkpoint> \
      --config.rl.guided_layers=all --name=train_rollout_gap_sft_all   # a trained policy

Samples with an FP4 W/A/KV rollout, then recomputes the sampled tokens' log-probs with the
training forward in each mode (`rtn`, `guided` with full and compact guidance, each with and
without routing replay; `off` on a BF16 rollout as the reference pair): log-prob gap, KL, code
mismatch at the guided sites, router agreement, guidance bytes per token
(`trace_jax.tables.gap`). The settings are `configs/train_rollout_gap.py`. Writes
`<outdir>/<name>.{md,json,png}` (the plot: code mismatch per layer and site).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib
from absl import app, flags

from experiments import harness
from trace_jax.quant.config import GUIDABLE_SITES
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.logs import quiet_third_party
from trace_jax.tables.gap import GapConfig, GapResult, measure_gap

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLUMNS = (
    "mode", "replay", "logp_gap_mean", "logp_gap_max", "kl", "code_mismatch",
    "one_apart_fraction", "router_agreement", "guidance_bytes_per_token",
)  # fmt: skip


def plot_per_layer(per_site: Sequence[dict], layers: Sequence[int], path: str) -> None:
    """Code mismatch against layer with routing replay, one panel per guidable site, one line
    per trainer mode; the guided layers shaded."""
    fig, axes = plt.subplots(
        1, len(GUIDABLE_SITES), figsize=(4 * len(GUIDABLE_SITES), 3.5), sharey=True
    )
    for ax, site in zip(axes, GUIDABLE_SITES, strict=True):
        for label in ("rtn", "guided full", "guided compact"):
            rs = [r for r in per_site if r["site"] == site and r["mode"] == label and r["replay"]]
            if rs:
                ax.plot(
                    [r["layer"] for r in rs],
                    [max(r["code_mismatch"], 1e-7) for r in rs],
                    "o-",
                    label=label,
                )
        ax.axvspan(min(layers) - 0.5, max(layers) + 0.5, color="k", alpha=0.06)
        ax.set(title=f"{site} (replay on)", xlabel="layer", yscale="log")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("code mismatch vs rollout (0 at 1e-7)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(
    config: ExperimentConfig, gap: GapConfig, result: GapResult, *, outdir: str, name: str
) -> dict[str, str]:
    """Writes `<outdir>/<name>.{md,json,png}` of a measurement; returns the md and json paths."""
    rl = config.rl
    notes = (
        f"{config.model.n_layers}-layer model, {result.policy}, recipe `{rl.format}`, guided "
        f"layers {list(result.guided_layers)} of {config.model.n_layers}, batch {gap.batch}, up "
        f"to {rl.max_new_tokens} new tokens at temperature {rl.temperature}. `code_mismatch`: "
        "fraction of the trainer's codes at the guided sites that differ from the rollout's "
        "(expert_mid compared on slots whose expert both sides used); `one_apart_fraction`: of "
        "those mismatches, the share one adjacent code apart. `kl`: KL(rollout || train) per "
        "response token, k3 estimator on the sampled tokens. `guidance_bytes_per_token`: "
        "guidance held per token slot for the guided sites."
        f"\n\n![per-layer mismatch]({name}.png)"
    )
    table = harness.markdown_table(result.rows, COLUMNS)
    paths = harness.write_results(
        name,
        result.rows,
        title="Train-rollout gap: FP4 rollout vs training forward",
        table=table,
        notes=notes,
        outdir=outdir,
        extra={"per_site": result.per_site},
    )
    plot_per_layer(result.per_site, result.guided_layers, os.path.join(outdir, f"{name}.png"))
    print(table)
    return paths


def main(argv):
    del argv
    f = flags.FLAGS
    quiet_third_party(f.verbose)
    config = ExperimentConfig.from_config_dict(f.config)
    gap = from_section(GapConfig, f.config.gap)
    paths = write(config, gap, measure_gap(config, gap), outdir=f.outdir, name=f.name)
    print(f"\nwrote {paths['md']} and {paths['json']}")


if __name__ == "__main__":
    harness.define_config_flag("train_rollout_gap")
    harness.define_result_flags("train_rollout_gap")
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl)")
    app.run(main)
