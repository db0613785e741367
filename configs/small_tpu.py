r"""The `small` preset on a TPU v5e-8 or v5p-8 slice (8 chips, one host): `small_gpu`'s run on a
(data 2, expert 4) mesh, with the Pallas kernels, which lower through Mosaic there. Install with
`pip install -r requirements-tpu.txt` (README, "TPU"). No TPU has run it yet.

  python -m experiments.sft --config=configs/small_tpu.py --workdir=/tmp/trace_small_tpu
  python -m experiments.main --config=configs/small_tpu.py --workdir=/tmp/trace_small_tpu \
      --config.rl.init_from=/tmp/trace_small_tpu/sft_checkpoint --config.rl.method=trace
"""

import ml_collections

from configs import small_gpu


def get_config() -> ml_collections.ConfigDict:
    c = small_gpu.get_config()
    # Rollout rows split 2 ways (256 per step: 128 per data shard), the 32 routed experts 4 ways (8
    # per chip); everything else is replicated (`trace_jax.rl.sharding`).
    c.mesh.data, c.mesh.expert = 2, 4
    # Named rather than "auto" (which picks the same on a TPU): on another platform the run stops
    # with an error instead of quietly running XLA. The rollout's FP4 kernels are the Mosaic ones;
    # the experts' bf16 grouped matmul is jax's megablox `gmm` (forward; the tiled form's backward).
    c.rl.rollout_implementation = "pallas"
    c.model.grouped_matmul = "pallas"
    return c
