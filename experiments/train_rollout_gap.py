r"""The train-rollout gap, measured: FP4 rollout vs teacher-forced training forward per mode.

Samples with an FP4 W/A/KV rollout (token-by-token decode over a packed FP4 KV cache, recording
full codes at every site for diagnostics), then recomputes the log-probs of the sampled tokens with
the training forward (one teacher-forced pass over prompt + response) in each mode: `rtn` (vanilla
FP4 QAT), `guided` with full and with compact guidance (at `--guidance_layers`), each with and
without routing replay; `off` on a BF16 rollout is the reference pair.

  python -m experiments.train_rollout_gap                      # tiny preset, CPU, < 5 min
  python -m experiments.train_rollout_gap --preset=small --batch=16 --max_new=256   # GPU
"""

from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from absl import app, flags, logging
from flax import nnx

from experiments import harness, sft
from trace_jax import fp4, tasks
from trace_jax.models import ModelConfig, init_model
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.quant.config import GUIDABLE_SITES
from trace_jax.rl.methods import layers_from_spec
from trace_jax.rollout import SamplingConfig, generate
from trace_jax.train import train_forward

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def guided_layers(spec: str, n_layers: int) -> tuple[int, ...]:
    """`--guidance_layers` (see `trace_jax.rl.methods.layers_from_spec`), as a usage error."""
    try:
        return layers_from_spec(spec, n_layers)
    except ValueError as e:
        raise app.UsageError(f"--guidance_layers: {e}") from None


def recipe(name: str, layers: tuple[int, ...]) -> QuantConfig:
    make = {
        "nvfp4": QuantConfig.nvfp4,
        "mxfp4_w4a4": QuantConfig.mxfp4_w4a4,
        "mxfp4_w4a8": QuantConfig.mxfp4_w4a8,
    }[name]
    return make(guided_layers=layers)


def gap_metrics(lp_train, lp_roll, mask) -> dict[str, float]:
    """Mean/max |logp gap| and KL(rollout || train) per token (k3 estimator on the samples)."""
    m = np.asarray(mask)
    d = (np.asarray(lp_train, np.float64) - np.asarray(lp_roll, np.float64))[m]
    kl = np.exp(d) - 1.0 - d  # unbiased, non-negative estimate of KL(rollout || train)
    return {
        "logp_gap_mean": float(np.mean(np.abs(d))),
        "logp_gap_max": float(np.max(np.abs(d))),
        "kl": float(np.mean(kl)),
    }


def router_agreement(train_experts, roll_experts, processed) -> float:
    """Mean fraction of the rollout's top-k experts the trainer also picked, per processed token."""
    t = np.asarray(train_experts)
    r = np.asarray(roll_experts)
    same = (t[..., :, None] == r[..., None, :]).any(-1).mean(-1)  # [L, B, S]
    m = np.broadcast_to(np.asarray(processed), same.shape)
    return float(same[m].mean())


def define_flags() -> None:
    """Command-line flags (defined only when run as a script)."""
    flags.DEFINE_enum("preset", "tiny", ["tiny", "small"], "model preset")
    flags.DEFINE_integer("n_layers", 0, "decoder blocks (0: the preset's)")
    flags.DEFINE_enum(
        "formats", "nvfp4", ["nvfp4", "mxfp4_w4a4", "mxfp4_w4a8"], "FP4 recipe (W/A/KV)"
    )
    flags.DEFINE_string(
        "guidance_layers", "half", "guided layers: half | quarter | eighth | all | comma list"
    )
    flags.DEFINE_integer("seed", 0, "PRNG seed")
    flags.DEFINE_integer("batch", 8, "sequences")
    flags.DEFINE_integer("prompt_len", 16, "max prompt length (lengths vary per row)")
    flags.DEFINE_integer("max_new", 48, "new tokens per sequence")
    flags.DEFINE_float("temperature", 1.0, "sampling temperature")
    flags.DEFINE_float(
        "init_std", 0.08, "initializer std of the random policy (larger: peakier distributions)"
    )
    flags.DEFINE_string(
        "checkpoint",
        "",
        "SFT checkpoint (experiments.sft's sft_checkpoint): a trained policy on "
        "task prompts instead of a random one",
    )
    flags.DEFINE_list("task_levels", ["1"], "task levels of the prompts (with --checkpoint)")
    flags.DEFINE_string("outdir", harness.RESULTS_DIR, "where results are written")
    flags.DEFINE_string("name", "train_rollout_gap", "result file stem")


def run(
    *,
    preset: str = "tiny",
    n_layers: int = 0,
    formats: str = "nvfp4",
    guidance_layers: str = "half",
    seed: int = 0,
    batch: int = 8,
    prompt_len: int = 16,
    max_new: int = 48,
    temperature: float = 1.0,
    init_std: float = 0.08,
    checkpoint: str = "",
    task_levels: tuple[int, ...] = (1,),
    outdir: str = harness.RESULTS_DIR,
    name: str = "train_rollout_gap",
) -> list[dict]:
    """Measures the gap in every mode and writes the results; returns the rows. `n_layers`: the
    model's decoder blocks (0: the preset's)."""
    presets = {"tiny": ModelConfig.tiny, "small": ModelConfig.small}
    cfg = presets[preset](init_std=init_std, **({"n_layers": n_layers} if n_layers else {}))
    layers = guided_layers(guidance_layers, cfg.n_layers)
    qcfg = recipe(formats, layers)
    key = jax.random.key(seed)
    k_prompt, k_len, k_sample = jax.random.split(key, 3)
    model = init_model(cfg, seed=seed)
    b, p = batch, prompt_len
    if checkpoint:
        # A trained policy (e.g. the SFT warm start) on task prompts, stopping at EOS.
        sft.load_params(model, checkpoint)
        stream = tasks.train_stream(seed, levels=tuple(int(lv) for lv in task_levels))
        problems = list(itertools.islice(stream, b))
        prompts, prompt_lengths = map(jnp.asarray, tasks.encode_prompts(problems, pad_to=p))
        sampling = SamplingConfig(
            max_new_tokens=max_new,
            temperature=temperature,
            stop_tokens=(tasks.EOS_ID,),
            pad_id=tasks.PAD_ID,
        )
        policy = (
            f"trained policy `{checkpoint}`, task prompts (levels {list(task_levels)}, seed {seed})"
        )
    else:
        prompts = jax.random.randint(k_prompt, (b, p), 1, cfg.vocab_size, jnp.int32)
        prompt_lengths = jax.random.randint(k_len, (b,), max(1, p // 2), p + 1, jnp.int32)
        sampling = SamplingConfig(max_new_tokens=max_new, temperature=temperature)
        policy = f"random init (std {init_std}), prompts of {p // 2}-{p} random tokens"
    graphdef, params = nnx.split(model)
    all_keys = qcfg.all_keys(cfg.n_layers)
    guided_keys = qcfg.guided_keys(cfg.n_layers)

    logging.info("BF16 rollout + BF16 training forward (reference pair)")
    roll_bf16 = generate(
        graphdef,
        params,
        prompts,
        prompt_lengths,
        k_sample,
        sampling=sampling,
        qcfg=qcfg,
        mode=SiteMode.OFF,
    )
    fwd = nnx.jit(train_forward, static_argnames=("qcfg", "mode", "replay", "temperature"))
    off = fwd(model, roll_bf16, qcfg=qcfg, mode=SiteMode.OFF, temperature=temperature)
    rows = [
        {
            "mode": "off (bf16 pair)",
            "replay": False,
            **gap_metrics(off.logprobs, roll_bf16.logprobs, roll_bf16.response_mask),
            "code_mismatch": float("nan"),
            "one_apart_fraction": float("nan"),
            "router_agreement": router_agreement(
                off.expert_choices, roll_bf16.expert_choices, roll_bf16.processed
            ),
            "guidance_bytes_per_token": 0.0,
        }
    ]

    logging.info("FP4 rollout, capturing full codes at every site")
    roll = generate(
        graphdef,
        params,
        prompts,
        prompt_lengths,
        k_sample,
        sampling=sampling,
        qcfg=qcfg,
        mode=SiteMode.RTN,
        capture=all_keys,
        capture_mode=fp4.GuidanceMode.FULL,
    )
    reference = roll.guidance
    full = {k: reference[k] for k in guided_keys}
    compact = {k: fp4.to_compact(g) for k, g in full.items()}
    # Bytes actually held per processed token (the buffers' padding slots are not counted).
    slots = roll.tokens.shape[0] * roll.tokens.shape[1]
    bytes_per_token = {
        "full": sum(g.nbytes for g in full.values()) / slots,
        "compact": sum(g.nbytes for g in compact.values()) / slots,
    }

    per_layer = {}
    for label, mode, guidance, gbytes in [
        ("rtn", SiteMode.RTN, None, 0.0),
        ("guided full", SiteMode.GUIDED, full, bytes_per_token["full"]),
        ("guided compact", SiteMode.GUIDED, compact, bytes_per_token["compact"]),
    ]:
        for replay in (False, True):
            out = fwd(
                model,
                roll,
                qcfg=qcfg,
                mode=mode,
                replay=replay,
                guidance=guidance,
                reference=reference,
                temperature=temperature,
            )
            guided_stats = [out.stats[k] for k in guided_keys]
            n_el = sum(int(s["n_elements"]) for s in guided_stats)
            n_mis = sum(int(s["n_mismatch"]) for s in guided_stats)
            n_one = sum(int(s["n_one_apart"]) for s in guided_stats)
            fallback = sum(int(c["rows"]) - int(c["guided_rows"]) for c in out.coverage.values())
            rows.append(
                {
                    "mode": label,
                    "replay": replay,
                    **gap_metrics(out.logprobs, roll.logprobs, roll.response_mask),
                    "code_mismatch": n_mis / max(n_el, 1),
                    "one_apart_fraction": n_one / n_mis if n_mis else float("nan"),
                    "router_agreement": router_agreement(
                        out.expert_choices, roll.expert_choices, roll.processed
                    ),
                    "guidance_bytes_per_token": gbytes,
                    "rtn_fallback_rows": fallback,
                }
            )
            per_layer[(label, replay)] = {k: float(s["mismatch"]) for k, s in out.stats.items()}
            logging.info("%s replay=%s: %s", label, replay, rows[-1])

    cols = [
        "mode",
        "replay",
        "logp_gap_mean",
        "logp_gap_max",
        "kl",
        "code_mismatch",
        "one_apart_fraction",
        "router_agreement",
        "guidance_bytes_per_token",
    ]
    table = harness.markdown_table(rows, cols)
    site_rows = []
    for (label, replay), stats in per_layer.items():
        for layer in range(cfg.n_layers):
            for s in GUIDABLE_SITES:
                key = f"{layer}/{s}"
                if key in stats:
                    site_rows.append(
                        {
                            "mode": label,
                            "replay": replay,
                            "layer": layer,
                            "site": s,
                            "code_mismatch": stats[key],
                        }
                    )
    notes = (
        f"Preset `{preset}`, {policy}, recipe "
        f"`{formats}`, guided layers {list(layers)} of {cfg.n_layers}, batch {b}, up to "
        f"{max_new} new tokens at temperature {temperature}. "
        "`code_mismatch`: fraction of the trainer's codes at the guided sites "
        "that differ from the rollout's (expert_mid compared on slots whose expert both sides "
        "used); `one_apart_fraction`: of those mismatches, the share one adjacent code apart. "
        "`kl`: KL(rollout || train) per response token, k3 estimator on the sampled tokens. "
        "`guidance_bytes_per_token`: guidance held per token slot for the guided sites."
    )
    paths = harness.write_results(
        name,
        rows,
        title="Train-rollout gap: FP4 rollout vs training forward",
        table=table,
        notes=notes + f"\n\n![per-layer mismatch]({name}.png)",
        outdir=outdir,
        extra={"per_site": site_rows},
    )
    plot_per_layer(site_rows, cfg.n_layers, layers, os.path.join(outdir, f"{name}.png"))
    print(table)
    print(f"\nwrote {paths['md']} and {paths['json']}")
    return rows


def plot_per_layer(site_rows, n_layers, layers, path):
    fig, axes = plt.subplots(
        1, len(GUIDABLE_SITES), figsize=(4 * len(GUIDABLE_SITES), 3.5), sharey=True
    )
    for ax, site in zip(axes, GUIDABLE_SITES, strict=True):
        for label in ("rtn", "guided full", "guided compact"):
            rs = [r for r in site_rows if r["site"] == site and r["mode"] == label and r["replay"]]
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


def main(argv):
    del argv
    f = flags.FLAGS
    run(
        preset=f.preset,
        n_layers=f.n_layers,
        formats=f.formats,
        guidance_layers=f.guidance_layers,
        seed=f.seed,
        batch=f.batch,
        prompt_len=f.prompt_len,
        max_new=f.max_new,
        temperature=f.temperature,
        init_std=f.init_std,
        checkpoint=f.checkpoint,
        task_levels=tuple(f.task_levels),
        outdir=f.outdir,
        name=f.name,
    )


if __name__ == "__main__":
    define_flags()
    app.run(main)
