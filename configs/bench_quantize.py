r"""Fused FP4 quantize + capture: every Pallas launch of `launches` against the XLA quantizer and a
copy of the same input (experiments/bench_quantize.py).

python -m experiments.bench_quantize                                            # on the H200
python -m experiments.bench_quantize --config.formats=nvfp4 --config.rows=16384
python -m experiments.bench_quantize --config=configs/bench_quantize.py:smoke   # CPU smoke run
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The H200 benchmark; `arg="smoke"`: tiny sizes, three launches, one timed call each."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per variant (numbers meaningless)
    c.ceiling_bytes = 1 << 30  # bytes of the bandwidth-ceiling measurement
    c.rows = 65536
    c.cols = 4096
    c.formats = ("nvfp4", "mxfp4")
    # (rows per program, column tile, warps, row-loop chunk) of `fp4_quantize`; None: the kernel's
    # whole-row default. The first is the kernel's plain whole-row launch. More warps per row
    # spread NVFP4's 256 blocks of 16 per 4096-wide row; column tiles give 2-D tiles and 8-16x
    # more programs; row-loop programs keep NVFP4's global scale inside the kernel. Launches
    # whose tile or chunk is not narrower than a row are skipped.
    c.launches = (
        (None, None, 4, None),
        (1, None, 2, None),
        (1, None, 8, None),
        (2, None, 8, None),
        (4, None, 8, None),
        (8, 512, 4, None),
        (4, 1024, 4, None),
        (16, 256, 4, None),
        (4, None, 4, 1024),
        (8, None, 4, 512),
        (8, None, 8, 1024),
        (2, None, 4, 2048),
        (1, None, 4, 2048),
        (2, None, 8, 2048),
    )
    if arg == "smoke":
        c.smoke = True
        c.ceiling_bytes = 1 << 20
        c.rows, c.cols = 256, 256
        c.launches = ((None, None, 4, None), (2, 64, 4, None), (2, None, 4, 64))
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
