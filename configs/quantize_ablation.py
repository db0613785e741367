r"""The fused quantize + capture kernel cut down stage by stage, on 65536 x 4096 bf16
(experiments/quantize_ablation.py).

python -m experiments.quantize_ablation                                        # on the H200
python -m experiments.quantize_ablation --config.block_rows=8 --config.block_cols=512
python -m experiments.quantize_ablation --config=configs/quantize_ablation.py:smoke  # CPU smoke
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The H200 input; `arg="smoke"`: 64 x 256 in interpret mode, one timed call per variant."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per variant (numbers meaningless)
    c.rows = 65536
    c.cols = 4096
    # The launch's tile: None takes the api's column tile (`api.COLUMN_TILE_ROWS` x
    # `api.COLUMN_TILE`), the launch the stages are cut from.
    c.block_rows = ml_collections.config_dict.placeholder(int)
    c.block_cols = ml_collections.config_dict.placeholder(int)
    if arg == "smoke":
        c.smoke = True
        c.rows, c.cols = 64, 256
        c.block_rows, c.block_cols = 2, 128
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
