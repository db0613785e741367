r"""Table 4 analog: MXFP4 W4A8 and W4A4 (FP4 KV), TRACE vs vanilla FP4 QAT, 3 seeds, `small`.

python -m experiments.paper_table --config=configs/table4_mxfp4.py --workdir=workdir/table4
"""

import ml_collections

from configs import small_gpu
from trace_jax.tables.grid import table_section


def get_config() -> ml_collections.ConfigDict:
    c = small_gpu.get_config()
    c.table = table_section(
        name="table4_mxfp4",
        title="Table 4 analog: MXFP4 rollouts, TRACE vs FP4 QAT",
        seeds=(0, 1, 2),
        runs=tuple(
            (f"{m} {fmt}", {"rl.method": m, "rl.format": fmt})
            for fmt in ("mxfp4_w4a8", "mxfp4_w4a4")
            for m in ("fp4_qat", "trace")
        ),
    )
    return c
