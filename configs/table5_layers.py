r"""Table 5 analog: TRACE with guidance on the last half / quarter / eighth / all layers, `small`.

python -m experiments.paper_table --config=configs/table5_layers.py --workdir=workdir/table5

`trace half` is TRACE's default recipe: run in one `experiments.table_session` with
`configs/table7_ptq.py`, it is trained once and shared with Table 7's `trace` runs.
"""

import ml_collections

from configs import small_gpu


def get_config() -> ml_collections.ConfigDict:
    c = small_gpu.get_config()
    c.table = ml_collections.ConfigDict(
        {
            "name": "table5_layers",
            "title": "Table 5 analog: which layers carry guidance (TRACE, NVFP4)",
            "seeds": (0, 1, 2),
            "runs": tuple(
                (f"trace {layers}", {"rl.method": "trace", "rl.guided_layers": layers})
                for layers in ("all", "half", "quarter", "eighth")
            ),
        }
    )
    return c
