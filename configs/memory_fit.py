r"""Whether the paper-sized model's training state fits in GPU memory (experiments/memory_fit.py).

python -m experiments.memory_fit
python -m experiments.memory_fit --config.meshes="((1, 8, 8),)" --config.capacities_GB="(141,)"
python -m experiments.memory_fit --config=configs/memory_fit.py:smoke

Per-device bytes of the parameters, AdamW state and gradients of `ModelConfig.<preset>` (all its
blocks) on each (data, fsdp, expert) mesh of `meshes`, from shapes alone: no array is allocated
and the meshes need not exist (`trace_jax.rl.memory_fit`), so it runs on any CPU in seconds.
`param_dtypes`: the master copy's dtype, float32 as in the preset and bfloat16 (AdamW's moments
follow it). Meshes of 8 devices (one node) and 64 (8 nodes of 8): replicated (data only), the
experts split (the (data, expert) placement), FSDP alone, and FSDP with the experts split.
`smoke`: the `tiny` model on two small meshes.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The paper-sized preset on 8 and 64 devices; `arg="smoke"`: the tiny model."""
    c = ml_collections.ConfigDict()
    c.smoke = False
    c.preset = "qwen3_5_35b_a3b"  # a key of trace_jax.rl.experiment.MODEL_PRESETS, all its blocks
    c.param_dtypes = ("float32", "bfloat16")
    # (data, fsdp, expert) sizes
    c.meshes = ((8, 1, 1), (1, 1, 8), (1, 8, 1), (1, 2, 4), (8, 1, 8), (8, 8, 1), (1, 8, 8))
    c.capacities_GB = (80.0, 141.0)  # GPU memory: H100 80GB, H200
    if arg == "smoke":
        c.smoke = True
        c.preset = "tiny"
        c.param_dtypes = ("float32",)
        c.meshes = ((1, 1, 1), (2, 2, 2))
        c.capacities_GB = (0.003,)  # the tiny state fits split 2 x 2 x 2, not whole
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
