r"""Table 1 analog: NVFP4 W/A/KV rollouts, every method, 3 seeds, on the `small` preset.

python -m experiments.paper_table --config=configs/table1_nvfp4.py --workdir=workdir/table1
"""

import ml_collections

from configs import small_gpu
from trace_jax.tables.grid import table_section


def get_config() -> ml_collections.ConfigDict:
    c = small_gpu.get_config()
    c.table = table_section(
        name="table1_nvfp4",
        title="Table 1 analog: NVFP4 W/A/KV rollout, pass@1 after GRPO",
        seeds=(0, 1, 2),
        runs=tuple(
            (m, {"rl.method": m, "rl.format": "nvfp4"})
            for m in ("bf16", "fp4_qat", "qarl", "quads", "trace")
        ),
    )
    return c
