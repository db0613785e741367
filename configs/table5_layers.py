r"""Table 5 analog: TRACE with guidance on the last half / quarter / eighth / all layers, `small`.

  python -m experiments.paper_table --config=configs/table5_layers.py --workdir=workdir/table5

`trace half` is TRACE's default recipe: queued together with `configs/table7_ptq.py` by
`experiments.run_tables`, it is trained once and shared with Table 7's `trace` runs.
"""

import ml_collections

from configs import small_gpu
from trace_jax.tables.grid import table_section


def get_config() -> ml_collections.ConfigDict:
    c = small_gpu.get_config()
    c.table = table_section(
        name="table5_layers",
        title="Table 5 analog: which layers carry guidance (TRACE, NVFP4)",
        seeds=(0, 1, 2),
        runs=tuple(
            (f"trace {layers}", {"rl.method": "trace", "rl.guided_layers": layers})
            for layers in ("all", "half", "quarter", "eighth")
        ),
    )
    return c
