"""Block-scaled low-precision formats: FP4 (E2M1) and FP8 (E4M3) elements with E8M0/E4M3 scales.

A `BlockFormat` names everything the quantizer needs to know about a format; it is frozen and
hashable so it can be a static argument of jitted functions and `custom_vjp` rules.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
import numpy as np


class ElementType(enum.Enum):
    """A sign-magnitude minifloat element type without infinities (OCP "fn" types)."""

    E2M1 = "e2m1"
    E4M3 = "e4m3"

    @property
    def spec(self) -> MiniFloatSpec:
        return _MINIFLOATS[self]


class ScaleType(enum.Enum):
    """The encoding of the per-block scale."""

    E8M0 = "e8m0"  # power of two, 2**(bits - 127); 0xFF is NaN
    E4M3 = "e4m3"  # an unsigned-in-practice E4M3 value; 0x7F is NaN


@dataclasses.dataclass(frozen=True)
class MiniFloatSpec:
    """Bit layout of a sign-magnitude minifloat (no inf; saturating conversions).

    The magnitude code `idx` (all bits but the sign) enumerates the non-negative grid in order, so
    adjacent grid points differ by one in `idx` and always in its lowest bit (the mantissa LSB).
    """

    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_value: float
    # Largest valid magnitude code; E4M3FN reserves 0x7F (idx 127) for NaN.
    max_code: int

    @property
    def total_bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def sign_shift(self) -> int:
        return self.exponent_bits + self.mantissa_bits

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal number (subnormals share its step)."""
        return 1 - self.bias

    @property
    def max_exponent(self) -> int:
        """floor(log2(max_value)): the exponent the MX scale rule subtracts."""
        return int(np.floor(np.log2(self.max_value)))

    def grid(self) -> np.ndarray:
        """All non-negative grid values, indexed by magnitude code (float64, host side)."""
        idx = np.arange(self.max_code + 1)
        e_field = idx >> self.mantissa_bits
        m = idx & ((1 << self.mantissa_bits) - 1)
        sub = m * 2.0 ** (self.min_exponent - self.mantissa_bits)
        normal = ((1 << self.mantissa_bits) + m) * 2.0 ** (e_field - self.bias - self.mantissa_bits)
        return np.where(e_field == 0, sub, normal)


_MINIFLOATS = {
    ElementType.E2M1: MiniFloatSpec(
        exponent_bits=2, mantissa_bits=1, bias=1, max_value=6.0, max_code=7
    ),
    ElementType.E4M3: MiniFloatSpec(
        exponent_bits=4, mantissa_bits=3, bias=7, max_value=448.0, max_code=126
    ),
}


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: `block_size` consecutive elements of the last axis share a scale.

    Attributes:
      name: lower-case name, e.g. "mxfp4".
      element: element minifloat type.
      block_size: elements per scale block along the last axis.
      scale: block scale encoding.
      has_global_scale: NVFP4's second-level float32 scale.
    """

    name: str
    element: ElementType
    block_size: int
    scale: ScaleType
    has_global_scale: bool

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {self.block_size}")
        if self.has_global_scale and self.scale is not ScaleType.E4M3:
            raise ValueError("a global scale is only defined with E4M3 block scales (NVFP4)")

    @property
    def elem(self) -> MiniFloatSpec:
        return self.element.spec

    @property
    def is_fp4(self) -> bool:
        return self.element is ElementType.E2M1

    @property
    def element_bits(self) -> int:
        return self.elem.total_bits

    @property
    def scale_dtype(self) -> jnp.dtype:
        if self.scale is ScaleType.E8M0:
            return jnp.dtype(jnp.float8_e8m0fnu)
        return jnp.dtype(jnp.float8_e4m3fn)

    def __repr__(self) -> str:
        return f"BlockFormat({self.name})"


MXFP4 = BlockFormat("mxfp4", ElementType.E2M1, 32, ScaleType.E8M0, has_global_scale=False)
NVFP4 = BlockFormat("nvfp4", ElementType.E2M1, 16, ScaleType.E4M3, has_global_scale=True)
MXFP8 = BlockFormat("mxfp8", ElementType.E4M3, 32, ScaleType.E8M0, has_global_scale=False)

# Name -> format: what `get_format` (and so every `fmt` given by name) resolves.
FORMATS: dict[str, BlockFormat] = {}


def register_format(fmt: BlockFormat, *, replace: bool = False) -> BlockFormat:
    """Makes `fmt` known by its name to `get_format` (and so to `QuantConfig`, the guidance
    store, ...); returns it. Names are lower case, as `get_format` looks them up.

    Raises TypeError when `fmt` is not a `BlockFormat`, ValueError on an upper-case name or
    when the name is registered and not `replace`.
    """
    if not isinstance(fmt, BlockFormat):
        raise TypeError(f"register_format takes a BlockFormat; got {fmt!r}")
    if not fmt.name or fmt.name != fmt.name.lower():
        raise ValueError(f"a format name is non-empty and lower case; got {fmt.name!r}")
    if fmt.name in FORMATS and not replace:
        raise ValueError(
            f"block format {fmt.name!r} is already registered; pass replace=True to redefine it"
        )
    FORMATS[fmt.name] = fmt
    return fmt


for _fmt in (MXFP4, NVFP4, MXFP8):
    register_format(_fmt)
del _fmt


def get_format(name: str | BlockFormat) -> BlockFormat:
    """Returns the registered format called `name` (case-insensitive: "mxfp4" | "nvfp4" |
    "mxfp8" | any `register_format`-ed name); a format passes through."""
    if isinstance(name, BlockFormat):
        return name
    if not isinstance(name, str) or name.lower() not in FORMATS:
        raise ValueError(f"unknown block format {name!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[name.lower()]
