r"""The FP4 decode-attention kernel cut down stage by stage, at the paper-like shape
(experiments/decode_attention_ablation.py).

python -m experiments.decode_attention_ablation                                # on the H200
python -m experiments.decode_attention_ablation --config.contexts=131072
python -m experiments.decode_attention_ablation --config=configs/decode_attention_ablation.py:smoke
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The paper-like shape on the H200; `arg="smoke"`: a tiny shape in interpret mode, one timed
    call per variant."""
    c = ml_collections.ConfigDict()
    c.smoke = False  # one warm-up and one timed call per variant (numbers meaningless)
    c.ceiling_bytes = 1 << 30  # bytes of the bandwidth-ceiling measurement
    c.contexts = (32768, 131072)
    c.batch = 16
    c.heads = 32
    c.kv_heads = 4
    c.head_dim = 128
    if arg == "smoke":
        c.smoke = True
        c.ceiling_bytes = 1 << 20
        c.contexts = (256,)
        c.batch, c.heads, c.kv_heads, c.head_dim = 2, 4, 2, 64
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
