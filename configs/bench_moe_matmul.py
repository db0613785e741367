r"""Grouped expert matmul sweep at decode and prefill sizes (experiments/bench_moe_matmul.py):
bf16 `ragged_dot`, the tiled XLA form, the bf16 Pallas kernel and the FP4 Pallas kernel (bf16 and
NVFP4 activations; weights decoded in the kernel, or before the call), each Pallas kernel over
its block configs, against a dense bf16 matmul of the same FLOPs and the read bandwidth measured
in the same run.

python -m experiments.bench_moe_matmul                                        # on the H200
python -m experiments.bench_moe_matmul --config.phases="(('prefill', 65536),)"
python -m experiments.bench_moe_matmul --config.block_configs.decode.pallas_bf16="({},)"
python -m experiments.bench_moe_matmul --config=configs/bench_moe_matmul.py:default_tiles  # ~2 min
python -m experiments.bench_moe_matmul --config=configs/bench_moe_matmul.py:smoke   # CPU smoke run

`block_configs.<phase>.<kernel>`: a tuple of dicts of the kernel's tiling keywords (block_m,
block_n, block_k, num_warps, num_stages; the FP4 kernel also `grid`), `{}` being the kernel's
`default_block_config` for the shape, `{"weights_left": True}` the defaults with the decoded FP4
weights as the dots' left operand, `{"split_by_scale_block": True}` with the codes read split by
scale block (both: `DECODE_LAYOUTS`); the `*_predecoded` kernels (weights decoded before the call)
take the bf16 kernel's tiles. The first entries are the defaults and their neighbours;
each list is about ten compiles, so the sweep takes a few minutes on the H200. `default_tiles`:
each Pallas kernel at its default tiles only (the FP4 kernel also in `DECODE_LAYOUTS`), at decode
and the large prefill (a re-measure after a kernel change).
"""

import ml_collections


def _bf16(block_m, block_n, block_k, num_warps, num_stages) -> dict:
    return dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )


WEIGHTS_LEFT = {"weights_left": True}
SPLIT = {"split_by_scale_block": True}
# The FP4 kernel's in-kernel decode layouts beside its defaults (kernel.BlockConfig), untimed.
DECODE_LAYOUTS = (WEIGHTS_LEFT, SPLIT, WEIGHTS_LEFT | SPLIT)
_fp4 = _bf16  # same keywords; the FP4 kernel's block_k counts both planes (block_k / 2 each)

# (block_m, block_n, block_k, num_warps, num_stages) per phase, beside the defaults ({}): their
# neighbours and the runners-up of the H200 sweep in experiments/results/kernels_moe_matmul.json of
# commit 75f6f28.
BF16_SWEEP = {
    "decode": [
        (16, 32, 128, 4, 4),
        (16, 64, 128, 4, 5),
        (16, 64, 128, 4, 3),
        (16, 64, 64, 4, 5),
        (16, 128, 64, 4, 5),
        (16, 64, 256, 4, 3),
        (16, 32, 256, 4, 3),
        (16, 128, 256, 8, 3),
        (32, 64, 128, 4, 4),
    ],
    "prefill_small": [
        (128, 64, 64, 4, 4),
        (128, 128, 64, 8, 4),
        (128, 128, 64, 4, 3),
        (128, 256, 64, 8, 3),
        (128, 128, 32, 8, 4),
        (128, 64, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (64, 128, 64, 4, 4),
        (64, 64, 128, 4, 3),
    ],
    "prefill": [
        (256, 128, 64, 8, 3),
        (256, 64, 64, 8, 3),
        (256, 128, 32, 8, 4),
        (256, 64, 64, 4, 4),
        (256, 128, 64, 4, 3),
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 256, 64, 8, 3),
        (128, 64, 64, 4, 4),
    ],
}
FP4_SWEEP = {
    "decode": [
        (16, 32, 256, 4, 3),
        (16, 64, 256, 4, 3),
        (16, 128, 256, 4, 3),
        (16, 64, 256, 4, 4),
        (16, 128, 256, 4, 2),
        (16, 64, 128, 4, 3),
        (16, 128, 128, 4, 4),
        (16, 64, 64, 4, 2),
        (16, 256, 256, 8, 3),
    ],
    "prefill_small": [
        (128, 128, 128, 8, 2),
        (128, 128, 128, 8, 3),
        (128, 256, 128, 8, 2),
        (128, 64, 128, 4, 3),
        (128, 128, 64, 8, 3),
        (64, 64, 128, 4, 3),
        (64, 128, 64, 4, 3),
        (64, 64, 64, 4, 2),
    ],
    "prefill": [
        (256, 128, 128, 8, 2),
        (128, 256, 128, 8, 2),
        (256, 64, 128, 8, 2),
        (256, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 128, 128, 4, 2),
        (128, 64, 128, 4, 3),
        (64, 64, 64, 4, 2),
    ],
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The paper-like expert layer on the H200; `arg="smoke"`: tiny sizes, one timed call."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per variant (numbers meaningless)
    c.experts = 128  # G
    c.d_model = 2048  # K
    c.d_ff = 768  # N: one expert's gate / up projection
    # (name, rows M = tokens x top-k): batch 64 x top-8 at decode; 1K and 8K prompt tokens x top-8.
    c.phases = (("decode", 512), ("prefill_small", 8192), ("prefill", 65536))
    # Rows per expert: 0 uniform at random; s > 0 expert e drawn with probability proportional
    # to (e + 1) ** -s (a skewed router; rows report the busiest expert's rows over the mean).
    c.routing_skew = 0.0
    c.ceiling_bytes = 1 << 30  # data read by the bandwidth ceilings
    c.rounds = 3  # side-by-side rounds of the best configs (medians reported)
    # Then each inside one device loop of about this many seconds of calls (0: not timed so),
    # loop_unroll calls an iteration: decode-size calls below the host's dispatch floor.
    c.loop_seconds = 0.05
    c.loop_unroll = 8
    c.block_configs = {
        phase: {
            "pallas_bf16": ({}, *(_bf16(*t) for t in BF16_SWEEP[phase])),
            "fp4_bf16_act": ({}, *(_fp4(*t) for t in FP4_SWEEP[phase])),
            "fp4_nvfp4_act": ({}, *(_fp4(*t) for t in FP4_SWEEP[phase])),
            # The weights decoded before the call: the bf16 kernel's grid and tiles.
            **{
                f"{kernel}_predecoded": ({}, *(_bf16(*t) for t in BF16_SWEEP[phase]))
                for kernel in ("fp4_bf16_act", "fp4_nvfp4_act")
            },
        }
        for phase in BF16_SWEEP
    }
    c.block_configs.prefill.fp4_bf16_act += ({"grid": "row_tiles"},)
    c.block_configs.prefill.fp4_nvfp4_act += ({"grid": "row_tiles"},)
    # The default tiles with the other decode layouts (kernel.BlockConfig).
    for phase in BF16_SWEEP:
        for kernel in ("fp4_bf16_act", "fp4_nvfp4_act"):
            c.block_configs[phase][kernel] += DECODE_LAYOUTS
    if arg == "smoke":
        c.smoke = True
        c.experts, c.d_model, c.d_ff = 4, 64, 64
        c.phases = (("decode", 24), ("prefill", 96))
        c.ceiling_bytes = 1 << 16
        c.rounds = 1
        c.loop_seconds, c.loop_unroll = 1e-9, 2  # one loop iteration of two calls each
        # Every path: default tiles, both FP4 grids, a config that fails (block_n 48 is no power
        # of two: recorded, skipped) and a kernel whose every config fails (its row says so).
        bf16, failing = {}, {"block_n": 48}
        row_tiles = {"block_m": 16, "block_k": 32, "grid": "row_tiles"}
        c.block_configs = {
            "decode": {
                "pallas_bf16": (bf16, failing),
                "fp4_bf16_act": ({}, WEIGHTS_LEFT | SPLIT),
                "fp4_nvfp4_act": (row_tiles,),
                "fp4_bf16_act_predecoded": ({},),
                "fp4_nvfp4_act_predecoded": ({"block_m": 16},),
            },
            "prefill": {
                "pallas_bf16": (failing,),
                "fp4_bf16_act": (row_tiles,),
                "fp4_nvfp4_act": ({},),
                "fp4_bf16_act_predecoded": ({},),
                "fp4_nvfp4_act_predecoded": ({},),
            },
        }
    elif arg == "default_tiles":
        phases = ("decode", "prefill")
        c.phases = tuple(p for p in c.phases if p[0] in phases)
        c.block_configs = {
            p: {
                k: ({}, *DECODE_LAYOUTS) if k in ("fp4_bf16_act", "fp4_nvfp4_act") else ({},)
                for k in c.block_configs[p]
            }
            for p in phases
        }
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; known: 'default_tiles', 'smoke'")
    return c
