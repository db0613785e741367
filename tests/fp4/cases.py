"""Named random test tensors for the quantizer: distributions, magnitudes and edge blocks."""

from __future__ import annotations

import numpy as np

from tests.fp4 import reference

ROWS, COLS = 32, 128  # 4 MX blocks or 8 NVFP4 blocks per row

# Exact-tie positions of x / scale between adjacent grid points, per element type.
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_TIES = (1.0625, 1.1875, 3.0625, 13.5, 104.0, 440.0, 1.5 * 2.0**-9, 2.0**-7 + 2.0**-10)


def _random(rng: np.random.Generator, kind: str) -> np.ndarray:
    shape = (ROWS, COLS)
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "uniform":
        return rng.uniform(-1, 1, shape)
    if kind == "laplace":
        return rng.laplace(size=shape)
    if kind == "student_t2":  # heavy tails: outliers dominate block maxima
        return rng.standard_t(2, size=shape)
    if kind == "lognormal_spread":  # magnitudes spanning many binades inside each block
        return rng.choice([-1, 1], shape) * np.exp(rng.normal(0, 4, shape))
    if kind == "outlier":
        x = rng.standard_normal(shape)
        x[:, ::16] *= 1000
        return x
    raise ValueError(kind)


KINDS = ("normal", "uniform", "laplace", "student_t2", "lognormal_spread", "outlier")
MAGNITUDES = (1e-30, 1e-6, 1.0, 1e6, 1e30)


def random_cases(seed: int) -> dict[str, np.ndarray]:
    """Random float32 tensors [ROWS, COLS] of every distribution and magnitude."""
    rng = np.random.default_rng(seed)
    out = {}
    for kind in KINDS:
        for mag in MAGNITUDES:
            x = _random(rng, kind) * mag
            x = np.clip(x, -1e37, 1e37)
            out[f"{kind}@{mag:g}"] = x.astype(np.float32)
    return out


def _power_of_two_row_scale(rng: np.random.Generator) -> float:
    """An NVFP4 row amax whose float32 global scale amax * f32(1/2688) is a power of two."""
    k = int(rng.integers(-20, 20))
    target = np.float32(2.0**k)
    inv = np.float32(1.0 / 2688.0)
    amax = np.float32(2688.0 * 2.0**k)
    for _ in range(8):
        if np.float32(amax * inv) == target:
            return float(amax)
        amax = np.nextafter(amax, np.float32(np.inf) if amax * inv < target else np.float32(0))
    raise AssertionError("no power-of-two global scale found")


def edge_cases(name: str, seed: int) -> np.ndarray:
    """Rows of zero blocks, exact ties, saturation-band values, tiny and huge blocks."""
    rng = np.random.default_rng(seed)
    fp4 = name != "mxfp8"
    bs = 16 if name == "nvfp4" else 32
    ties = E2M1_TIES if fp4 else E4M3_TIES
    top = 4.0 if fp4 else 256.0  # a block max whose MX exponent is exactly k
    x = rng.standard_normal((ROWS, COLS))
    x[0] = 0.0  # all-zero row
    x[1, :bs] = 0.0  # one all-zero block in a live row
    for r in range(2, ROWS):
        # Scale X = 2**k per block (MX) or combined power of two (NVFP4): ties are exact.
        k = int(rng.integers(-30, 30))
        if name == "nvfp4":
            amax = _power_of_two_row_scale(rng)
            gs = np.float32(amax) * np.float32(1.0 / 2688.0)
            x[r] = rng.standard_normal(COLS) * float(gs)
            x[r, 0] = amax  # sets the row's global scale; block 0 scale 448 * gs
            for b in range(1, COLS // bs):
                j = int(rng.integers(-6, 8))
                scale = float(gs) * 2.0**j
                blk = rng.choice([-1, 1], bs) * rng.choice(ties, bs) * scale
                blk[0] = 6.0 * scale  # block max: s_b rounds to exactly 2**j
                if r % 3 == 0:  # saturation band: a max just under the next E4M3 scale step
                    blk[1] = 6.0 * scale * 1.06
                x[r, b * bs : (b + 1) * bs] = blk
        else:
            scale = 2.0**k
            for b in range(COLS // bs):
                blk = rng.choice([-1, 1], bs) * rng.choice(ties, bs) * scale
                blk[0] = top * scale
                if r % 3 == 0:  # saturation band: max in [top, 2 * top), beyond the element max
                    blk[0] = (7.9 if fp4 else 500.0) * scale
                x[r, b * bs : (b + 1) * bs] = blk
    return x.astype(np.float32)


def coverage(x: np.ndarray, name: str) -> dict[str, int]:
    """How many exact ties, saturated elements and all-zero blocks `x` exercises (reference)."""
    ref = reference.ref_quantize(x, name)
    fp4 = name != "mxfp8"
    ties = np.asarray(E2M1_TIES if fp4 else E4M3_TIES)
    vmax = 6.0 if fp4 else 448.0
    bs = 16 if name == "nvfp4" else 32
    blocks = np.abs(x).reshape(x.shape[0], -1, bs).max(-1)
    return {
        "ties": int(np.isin(np.abs(ref.z), ties).sum()),
        "saturated": int((np.abs(ref.z) > vmax).sum()),
        "zero_blocks": int((blocks == 0).sum()),
    }
