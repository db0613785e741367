r"""The collectives of the data-parallel rollout, per decode step and per layer, with the MoE
routed per device and by GSPMD.

For each variant of the config (bf16, fp4) and each MoE routing, compiles the rollout
(`trace_jax.rollout.generate`) for a data mesh of `devices` devices and counts the collective
instructions of the compiled program (`trace_jax.rollout.collectives`); nothing runs on the
devices. Sizes and launch commands: configs/rollout_collectives.py. Writes
`<outdir>/<name>.{md,json}` (default `rollout_collectives`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict

from experiments import harness
from kernels_pallas import common as kernel_common
from trace_jax.models import init_model
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rl.experiment import MODEL_PRESETS
from trace_jax.rl.methods import get_method
from trace_jax.rl.sharding import make_mesh, shard_batch, shard_model
from trace_jax.rollout import SamplingConfig
from trace_jax.rollout.collectives import collective_counts, rollout_collectives

ROUTINGS = {"per_device": True, "gspmd": False}  # ModelConfig.moe_routing_per_device
COLUMNS = (
    "variant", "moe_routing", "decode_step", "decode_moe", "decode_moe_per_layer",
    "decode_attention", "decode_other", "decode_ops", "prefill", "prefill_moe", "other",
)  # fmt: skip


def _rollout_settings(variant: str, config: ConfigDict, n_layers: int) -> dict:
    """`generate`'s settings of a variant: "bf16" (no FP4 site, XLA) or "fp4" (the method's
    rollout on the Pallas kernels)."""
    if variant == "bf16":
        return dict(qcfg=QuantConfig.nvfp4(), mode=SiteMode.OFF, implementation="xla")
    if variant == "fp4":
        setup = get_method(config.method).setup(config.recipe, n_layers)
        return dict(
            qcfg=setup.rollout_qcfg, mode=setup.rollout_mode, capture=setup.capture,
            capture_mode=setup.capture_mode, implementation="pallas",
        )  # fmt: skip
    raise ValueError(f"config.variants: unknown variant {variant!r}; expected 'bf16' or 'fp4'")


def count(config: ConfigDict, variant: str, per_device: bool) -> dict:
    """One row: the collectives of the compiled rollout of `variant` with the MoE routing."""
    overrides = {"moe_routing_per_device": per_device}
    if config.n_layers:
        overrides["n_layers"] = config.n_layers
    cfg = dataclasses.replace(MODEL_PRESETS[config.preset](), **overrides)
    mesh = make_mesh(config.devices)
    model = init_model(cfg, seed=0)
    shard_model(model, mesh)
    b, p = config.prompts, config.prompt_tokens
    prompts = jnp.ones((b, p), jnp.int32)
    lengths = jnp.full((b,), p, jnp.int32)
    sampling = SamplingConfig(max_new_tokens=config.new_tokens, temperature=1.0, stop_tokens=(1,))
    settings = _rollout_settings(variant, config, cfg.n_layers)
    pallas = settings["implementation"] == "pallas" and kernel_common.native_lowering() is None
    interpret = kernel_common.interpreting(True) if pallas else contextlib.nullcontext()
    with jax.set_mesh(mesh), interpret:
        prompts, lengths = shard_batch((prompts, lengths), mesh, b)
        graphdef, params = nnx.split(model)
        found = rollout_collectives(
            graphdef, params, prompts, lengths, jax.random.key(0), sampling=sampling, **settings
        )
    routing = "per_device" if per_device else "gspmd"
    return {"variant": variant, "moe_routing": routing, **collective_counts(found, cfg.n_layers)}


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Rows of `count` for every variant and routing; prints them as a table and writes
    `<outdir>/<name>.{md,json}`."""
    if config.preset not in MODEL_PRESETS:
        raise ValueError(
            f"config.preset={config.preset!r}; expected one of {sorted(MODEL_PRESETS)}"
        )
    if config.devices < 2 or config.prompts % config.devices:
        raise ValueError(
            f"config.devices={config.devices} must be >= 2 and divide config.prompts="
            f"{config.prompts}"
        )
    if jax.device_count() < config.devices:
        raise ValueError(
            f"a {config.devices}-device mesh needs {config.devices} devices, have "
            f"{jax.device_count()} (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{config.devices})"
        )
    rows = [
        count(config, variant, per_device)
        for variant in config.variants
        for per_device in ROUTINGS.values()
    ]
    n_layers = config.n_layers or MODEL_PRESETS[config.preset]().n_layers
    notes = (
        f"`{config.preset}` ({n_layers} blocks), {config.prompts} prompts of "
        f"{config.prompt_tokens} tokens, {config.new_tokens} new tokens, on a {config.devices}-"
        "device data mesh (`trace_jax.rl.sharding`: rows split, parameters replicated; on a CPU "
        f"run with `XLA_FLAGS=--xla_force_host_platform_device_count={config.devices}`); the "
        "compiled rollout's collective instructions (`trace_jax.rollout.collectives`), nothing "
        "run. `decode_step`: those of the decode loop (body and test), each run once a decode "
        "step; of them `decode_moe` inside the blocks' MoE (`decode_moe_per_layer` per block), "
        "`decode_attention` inside their attention, `decode_other` outside the blocks (sampling, "
        "the loop's every-row-finished test); `decode_ops` by op. `prefill`: the prefill's (once "
        "a chunk), `prefill_moe` of them in the MoE; `other`: the rest (first sample, record "
        "writes after the loop). `moe_routing`: `per_device` each device routes, multiplies and "
        "combines its own rows in a shard_map (`ModelConfig.moe_routing_per_device`, "
        "`moe.rows_per_device`); `gspmd` the partitioner routes all rows together (the earlier "
        "path, and the trainer's). `fp4`: the "
        f"`{config.method}` method's {config.recipe} rollout on the Pallas kernels (interpreted "
        "where Pallas does not compile). Compiled by this host's backend: a GPU's partitioner "
        "and grouped matmul may differ."
    )
    table = harness.write_table(
        name, rows, COLUMNS, title="Collectives of the data-parallel rollout", notes=notes,
        fmt=".3g", outdir=outdir,
    )  # fmt: skip
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="rollout_collectives", name="rollout_collectives")
