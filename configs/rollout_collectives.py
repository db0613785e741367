r"""Collectives of the data-parallel rollout's program (experiments/rollout_collectives.py).

  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m experiments.rollout_collectives
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m experiments.rollout_collectives \
      --config=configs/rollout_collectives.py:smoke --outdir=/tmp/rc

Compiles (never runs) `trace_jax.rollout.generate` of a randomly initialized `ModelConfig.<preset>`
for a `devices`-device data mesh, parameters replicated and `prompts` prompt rows split as the
RL workers place them, and counts the collectives in its HLO per decode step, per layer and in
the prefill (`trace_jax.rollout.collectives`), with the MoE routed per device
(`ModelConfig.moe_routing_per_device`, the default) and by GSPMD (the earlier path). Variants:
"bf16" (SiteMode.OFF, XLA) and "fp4" (the `trace` method's NVFP4 rollout on the Pallas kernels,
interpreted where Pallas does not compile: a CPU compile takes minutes for `small`). On a CPU:
the host platform's partitioner and kernels, not a GPU's. `smoke`: the 2-block `tiny` model.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """`small` (the GPU runs' model) on 2 devices; `arg="smoke"`: 2-block `tiny`."""
    c = ml_collections.ConfigDict()
    c.smoke = False
    c.preset = "small"  # a key of trace_jax.rl.experiment.MODEL_PRESETS
    c.n_layers = 0  # 0: the preset's
    c.devices = 2  # the data axis; the process needs that many devices (XLA_FLAGS on a CPU)
    c.prompts = 4  # rows of the batch, a multiple of `devices`
    c.prompt_tokens = 16
    c.new_tokens = 4
    c.variants = ("bf16", "fp4")
    c.method = "trace"  # the fp4 variant's rollout settings (trace_jax.rl.methods)
    c.recipe = "nvfp4"
    if arg == "smoke":
        c.smoke = True
        c.preset = "tiny"
        c.n_layers = 2
        c.prompt_tokens = 6
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
