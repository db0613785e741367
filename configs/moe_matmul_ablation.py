r"""The FP4 MoE grouped matmul at decode, cut down to kernel bodies over one launch, at the
Qwen3-30B-A3B expert shape (experiments/moe_matmul_ablation.py).

python -m experiments.moe_matmul_ablation                                  # on the H200
python -m experiments.moe_matmul_ablation --config.variants="('full','bf16w')" --config.split_k="()"
python -m experiments.moe_matmul_ablation --config=configs/moe_matmul_ablation.py:smoke
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The Qwen3-30B-A3B expert shape on the H200 (43 kernels); `arg="smoke"`: a tiny shape in
    interpret mode, every variant and option once, one timed call each."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per kernel (numbers meaningless)
    c.ceiling_bytes = 1 << 30  # bytes of the bandwidth-ceiling measurement
    c.experts = 128  # G
    c.d_model = 2048  # K, the contraction
    c.d_ff = 768  # N
    # A decode step's rows of one expert (512 rows over 128 experts: 4), padded to the tensor
    # cores' smallest tile.
    c.rows_per_expert = 16
    c.variants = ("stream", "decode", "dot", "full", "f16", "f16asm", "stream32", "full32", "bf16w")
    c.variants += ("f16asm_wl", "bf16w_wl")  # the weights as the dots' left operand
    c.no_hints = ("stream", "full")  # timed again without the alignment hints
    c.split_k = (2, 4)  # K splits, at the first block config
    c.split_k_variants = ("full", "bf16w")
    # experts walked in turn by one program, at the first block config: fewer, longer programs
    c.experts_per_program = (4, 16)
    c.experts_per_program_variants = ("stream", "f16asm", "bf16w")
    # (block_n, block_k, num_warps, num_stages): the FP4 kernel's decode default, a wide-tile
    # config and the prefill tiles (every variant runs every one).
    c.block_configs = ((64, 256, 4, 3), (128, 256, 8, 3), (128, 128, 4, 3))
    c.rounds = 5  # alternating timing rounds (`experiments.timing.time_interleaved`)
    # Then each inside one device loop of about this many seconds of launches (0: not timed so),
    # loop_unroll launches an iteration: below the host's per-call dispatch floor.
    c.loop_seconds = 0.05
    c.loop_unroll = 8
    if arg == "smoke":
        c.smoke = True
        c.ceiling_bytes = 1 << 20
        c.experts, c.d_model, c.d_ff = 2, 256, 128
        c.split_k = (2,)
        c.experts_per_program = (2,)
        c.block_configs = ((64, 128, 4, 3),)
        c.rounds = 1
        c.loop_seconds, c.loop_unroll = 1e-9, 2  # one loop iteration of two launches
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
