r"""The quantizer's bits on the device against the host CPU (experiments/platform_numerics.py).

python -m experiments.platform_numerics --config.sections="('reciprocal', 'quantize')"  # on a GPU
python -m experiments.platform_numerics --config.sections=sensitivity  # a CPU measurement
python -m experiments.platform_numerics --config=configs/platform_numerics.py:smoke
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Full sizes; `arg="smoke"`: small sizes (on a CPU-only machine every count must be 0)."""
    c = ml_collections.ConfigDict()
    c.smoke = False
    c.sections = ("reciprocal", "quantize", "sensitivity")
    c.reciprocal_elements = 1 << 22  # random float32 divisors
    c.shape = (8192, 4096)  # bf16 tensors quantized on both platforms
    if arg == "smoke":
        c.smoke = True
        c.reciprocal_elements = 1 << 14
        c.shape = (64, 256)
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
