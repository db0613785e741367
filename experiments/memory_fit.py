r"""Whether the paper-sized model's training state fits in GPU memory, on 8 and 64 devices.

Per-device bytes of the parameters, the AdamW state and the gradients of `ModelConfig.<preset>`
on each (data, fsdp, expert) mesh of the config, from shapes alone (`trace_jax.rl.memory_fit`:
nothing is allocated and the mesh's devices need not exist), against each GPU memory size.
Sizes and launch commands: configs/memory_fit.py. Writes `<outdir>/<name>.{md,json}` (default
`memory_fit`).
"""

from __future__ import annotations

from ml_collections import ConfigDict

from experiments import harness
from trace_jax.models import param_count
from trace_jax.rl.experiment import MODEL_PRESETS
from trace_jax.rl.memory_fit import GB, memory_fit_rows


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """The rows of `memory_fit_rows` for the config; prints them as a table and writes
    `<outdir>/<name>.{md,json}`."""
    if config.preset not in MODEL_PRESETS:
        known = sorted(MODEL_PRESETS)
        raise ValueError(f"config.preset={config.preset!r}; expected one of {known}")
    cfg = MODEL_PRESETS[config.preset]()
    rows = memory_fit_rows(
        cfg, config.meshes, capacities_gb=config.capacities_GB, param_dtypes=config.param_dtypes
    )
    block = 3 * cfg.n_experts * cfg.d_model * cfg.d_ff_expert * 4  # one block's experts, float32
    capacities = " and ".join(f"{c:g} GB" for c in config.capacities_GB)
    notes = (
        f"`{config.preset}` ({param_count(cfg) / 1e9:.4g}B parameters, {cfg.n_layers} blocks), "
        "from shapes alone (`trace_jax.rl.memory_fit`: `nnx.eval_shape` of the model and its "
        "`nnx.Optimizer`, placed by `trace_jax.rl.sharding` on an `AbstractMesh`). Per device: "
        "`params_GB` the master copy in `param_dtype` (float32 is the preset's; the forward "
        "computes in bf16 either way), `optimizer_GB` AdamW's two moments in the same dtype "
        "(placed like their parameters) and its counters, `gradients_GB` one gradient per "
        "parameter with its dtype and placement; `state_GB` their sum. Meshes are (data, fsdp, "
        "expert): data replicates the parameters, fsdp splits every matrix along its largest "
        "dimension it divides, expert splits the routed experts along E. "
        f"`left_<C>GB` = C - `state_GB` for GPU memory C ({capacities}, in 1e9-byte GB: a "
        "little under what an H100 80GB or an H200 reports), `fits_<C>GB` whether it is >= 0. "
        "That headroom is not measured here and has to hold what the state leaves out: "
        "activations and what the backward saves of them, a block's weights while FSDP has "
        f"them gathered (one block's routed experts are {block / GB:.3g} GB in float32, divided "
        "by the expert axis), the rollout's KV cache, XLA's temporaries and the runtime's "
        "reserve. JAX preallocates 75% of a GPU's memory unless "
        "`XLA_PYTHON_CLIENT_MEM_FRACTION` says otherwise."
    )
    table = harness.write_table(
        name, rows, list(rows[0]), title="Per-device training state of the paper-sized model",
        notes=notes, fmt=".3g", outdir=outdir,
    )  # fmt: skip
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="memory_fit", name="memory_fit")
