r"""Train/rollout FP4 code mismatch on synthetic activations, with and without rollout guidance.

Draws activation-like tensors `x_train` (per-channel log-normal scales and a few outlier channels,
as in LLM hidden states) and `x_rollout = x_train * (1 + eps * noise)`, quantizes both, and reports
per eps and format how often their codes differ under round-to-nearest (each side its own scales)
and under guided rounding (full and compact guidance captured from the rollout), how many RTN
mismatches are one adjacent code apart, the dequantized gap, and the guidance size. Sweep:
configs/mismatch_analysis.py. Writes `<outdir>/<name>.{md,json,png}` (default
`mismatch_analysis`).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import matplotlib
from absl import logging
from ml_collections import ConfigDict
from tqdm import tqdm

from experiments import harness
from trace_jax import fp4

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def activation_like(key: jax.Array, rows: int, cols: int) -> jax.Array:
    """float32 [rows, cols]: normal values times log-normal channel scales, 1% outlier channels."""
    k_x, k_s, k_o = jax.random.split(key, 3)
    channel_scale = jnp.exp(0.75 * jax.random.normal(k_s, (cols,)))
    outliers = jnp.where(jax.random.uniform(k_o, (cols,)) < 0.01, 20.0, 1.0)
    return jax.random.normal(k_x, (rows, cols)) * channel_scale * outliers


@functools.partial(jax.jit, static_argnames="fmt")
def compare(x_train: jax.Array, x_rollout: jax.Array, fmt: fp4.BlockFormat) -> dict:
    """All statistics for one (eps, format) point."""
    q_roll = fp4.quantize(x_rollout, fmt)
    q_rtn = fp4.quantize(x_train, fmt)
    v_roll = fp4.dequantize(q_roll)
    norm = jnp.linalg.norm(v_roll)
    rtn = fp4.mismatch_stats(q_rtn.codes, q_roll.codes, fmt)
    # Blocks whose own block scales differ between the two sides (a flip of the E8M0 exponent, or
    # of the E4M3 block scale): every code in them may move, not only those near a boundary.
    # (NVFP4's float32 global scale differs in almost every row and is not counted here.)
    scale_bits = lambda q: jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
    same_scale = jnp.repeat(scale_bits(q_rtn) == scale_bits(q_roll), fmt.block_size, axis=-1)
    same = fp4.mismatch_stats(q_rtn.codes, q_roll.codes, fmt, where=same_scale)
    out = {
        "rtn_mismatch": rtn["mismatch"],
        "one_apart_fraction": rtn["one_apart_fraction"],
        "one_apart_fraction_same_scale": same["one_apart_fraction"],
        "scale_flip_share": 1.0 - same["n_mismatch"] / jnp.maximum(rtn["n_mismatch"], 1),
        "rtn_l2_gap": jnp.linalg.norm(fp4.dequantize(q_rtn) - v_roll) / norm,
    }
    for mode in ("full", "compact"):
        g = fp4.make_guidance(q_roll, mode)
        q = fp4.quantize(x_train, fmt, rounding="guided", guidance=g)
        st = fp4.mismatch_stats(q.codes, q_roll.codes, fmt)
        out[f"guided_{mode}_mismatch"] = st["mismatch"]
        out[f"guided_{mode}_l2_gap"] = jnp.linalg.norm(fp4.dequantize(q) - v_roll) / norm
    return out


def plot(rows: list[dict], path: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in sorted({r["format"] for r in rows}):
        rs = [r for r in rows if r["format"] == name]
        eps = [r["eps"] for r in rs]
        (line,) = axes[0].loglog(eps, [r["rtn_mismatch"] for r in rs], "o-", label=f"{name} RTN")
        c = line.get_color()
        axes[0].loglog(
            eps,
            [max(r["guided_compact_mismatch"], 1e-9) for r in rs],
            "s--",
            c=c,
            label=f"{name} guided (compact)",
        )
        axes[1].loglog(eps, [r["rtn_l2_gap"] for r in rs], "o-", c=c, label=f"{name} RTN")
        axes[1].loglog(
            eps,
            [max(r["guided_compact_l2_gap"], 1e-9) for r in rs],
            "s--",
            c=c,
            label=f"{name} guided (compact)",
        )
    axes[0].set(
        xlabel="eps (relative train/rollout perturbation)",
        ylabel="code mismatch rate (0 drawn at 1e-9)",
        title="codes differing from the rollout's",
    )
    axes[1].set(
        xlabel="eps", ylabel="||Q_train - Q_rollout|| / ||Q_rollout||", title="dequantized gap"
    )
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(
    config: ConfigDict, *, outdir: str = harness.RESULTS_DIR, name: str = "mismatch_analysis"
) -> list[dict]:
    """Runs the sweep and writes `<outdir>/<name>.{md,json,png}`; returns the rows."""
    n_rows, n_cols = config.rows, config.cols
    formats = [fp4.get_format(f) for f in config.formats]
    if n_cols % 32:
        raise ValueError(f"config.cols must be a multiple of 32, got {n_cols}")
    k_x, k_n = jax.random.split(jax.random.key(config.seed))
    x_train = activation_like(k_x, n_rows, n_cols)
    noise = jax.random.normal(k_n, x_train.shape)

    rows = []
    for fmt in formats:
        for eps in tqdm([float(e) for e in config.eps], desc=fmt.name):
            x_rollout = x_train * (1 + eps * noise)
            stats = {k: float(v) for k, v in compare(x_train, x_rollout, fmt).items()}
            rows.append(
                {
                    "eps": eps,
                    "format": fmt.name,
                    **stats,
                    "full_bits_per_element": fp4.guidance_bits_per_element(fmt, "full"),
                    "compact_bits_per_element": fp4.guidance_bits_per_element(fmt, "compact"),
                }
            )
            logging.info("%s eps=%g: %s", fmt.name, eps, stats)

    cols = [
        "format",
        "eps",
        "rtn_mismatch",
        "guided_full_mismatch",
        "guided_compact_mismatch",
        "one_apart_fraction",
        "one_apart_fraction_same_scale",
        "scale_flip_share",
        "rtn_l2_gap",
        "guided_full_l2_gap",
        "guided_compact_l2_gap",
        "full_bits_per_element",
        "compact_bits_per_element",
    ]
    table = harness.markdown_table(rows, cols)
    notes = (
        f"{n_rows} x {n_cols} activation-like float32 tensor (normal values, log-normal "
        "channel scales, 1% outlier channels x20); `x_rollout = x_train * (1 + eps * N(0, 1))`. "
        "RTN: each side rounds to nearest with its own scales. Guided: the trainer uses the "
        "rollout's scales and its full codes or compact mantissa bits. `one_apart_fraction`: of "
        "the RTN mismatches, those exactly one adjacent grid point apart. NVFP4 global scale per "
        "row. Bits per element include the block scale (NVFP4: + 32 bits per row not counted). "
        "`one_apart_fraction_same_scale`: the same, counting only blocks whose scales agree; "
        "`scale_flip_share`: the share of RTN mismatches that sit in blocks whose own block scales "
        "differ between the two sides (an E8M0 exponent flip when a block max crosses a power of "
        "two moves the whole block). Guided rounding uses the rollout's scales, so it has no "
        "scale flips. In the plot, zero mismatch is drawn at 1e-9."
    )
    paths = harness.write_results(
        name,
        rows,
        title="Mismatch analysis: FP4 codes, train vs rollout",
        table=table,
        notes=notes + f"\n\n![mismatch]({name}.png)",
        outdir=outdir,
    )
    plot(rows, os.path.join(outdir, f"{name}.png"))
    print(table)
    print(f"\nwrote {paths['md']}, {paths['json']} and {name}.png")
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="mismatch_analysis", name="mismatch_analysis")
