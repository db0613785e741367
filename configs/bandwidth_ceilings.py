r"""The device's read and copy bandwidth by size (experiments/bandwidth_ceilings.py).

python -m experiments.bandwidth_ceilings                                        # on the H200
python -m experiments.bandwidth_ceilings --config.sizes_mb="(100, 1024)"
python -m experiments.bandwidth_ceilings --config=configs/bandwidth_ceilings.py:smoke  # CPU smoke
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Sizes from a decode step's expert weights (12 layers of Qwen3-30B-A3B read per matmul: about
    100 MB in NVFP4, 400 MB in bf16) up to the 1 GiB the ceilings are quoted at; `arg="smoke"`:
    two small sizes, one timed call each."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per size (numbers meaningless)
    c.sizes_mb = (16, 32, 64, 100, 200, 400, 1024, 2048)  # MiB, each a multiple of 4 bytes
    if arg == "smoke":
        c.smoke = True
        c.sizes_mb = (1, 2)
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
