"""Shared pieces of the Pallas kernels: where and how they run, Triton params, in-kernel decode.

Every kernel package (`kernels_pallas/<op>/`) has a plain-jnp `reference.py`, a Pallas `kernel.py`
(Triton lowering, NVIDIA GPUs), a Pallas `mosaic.py` (Mosaic lowering, TPUs; the bf16 grouped
matmul uses jax's megablox) and an `api.py`, the op's one public interface. Its
`implementation=` keyword (tokamax's convention, `implementation_order`): None (default: Pallas
where it compiles natively, with the XLA reference as fallback; the reference alone elsewhere),
"pallas" (the kernel; NotImplementedError where it cannot take the shapes, and
PallasUnavailableError, a NotImplementedError, where Pallas does not compile and no
interpretation was asked for), "xla" (the reference), or a sequence of names tried in order.

Where: kernels are built for `kernel_platform()`, JAX's default backend unless inside
`lowering_for(platform)` (lowering on a CPU for a GPU or a TPU). How (`pallas_target`): natively,
the Triton kernel on a GPU and the Mosaic kernel on a TPU; interpreted only when asked, by an
op's `interpret=` (True: the Triton kernel in Pallas' generic interpreter;
`pltpu.InterpretParams(...)`: the Mosaic kernel in the TPU interpreter) or, for calls that do
not pass it (the model's), the `interpreting(...)` context. Each api says what runs:
`*_with_implementation` return the implementation with the result; the decode-attention ops plan
their call first (`*_plan(...)`: implementation, lowering, interpretation).

In-kernel decoding reuses `trace_jax.fp4.numerics` (comparisons, shifts, float32 bit fields: all
Pallas-friendly), so kernels and the quantizer share one definition of every format. Block scales
enter kernels as their uint8 bit patterns (Triton has no E8M0 type).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from trace_jax.fp4 import BlockFormat, ElementType, ScaleType, numerics
from trace_jax.fp4.scales import scale_bits_to_float32


class Implementation(enum.StrEnum):
    """How a kernel op runs: its Pallas kernel or its plain-XLA (pure-jnp) reference."""

    PALLAS = "pallas"
    XLA = "xla"


class Lowering(enum.StrEnum):
    """The Pallas lowering of an op's kernel: Triton (`<op>/kernel.py`, NVIDIA GPUs) or Mosaic
    (`<op>/mosaic.py`, TPUs)."""

    TRITON = "triton"
    MOSAIC = "mosaic"


# What an op's `implementation=` accepts: None, a name, or names to try in order.
ImplementationLike = str | Implementation | Sequence[str | Implementation] | None
# What an op's `interpret=` accepts (`pallas_target`).
Interpret = bool | pltpu.InterpretParams | None
# The default order where Pallas compiles natively.
NATIVE_ORDER = (Implementation.PALLAS, Implementation.XLA)
# The platforms kernels are built for (`jax.default_backend()` names), and where Pallas compiles.
PLATFORMS = ("cpu", "gpu", "tpu")
NATIVE_LOWERING = {"gpu": Lowering.TRITON, "tpu": Lowering.MOSAIC}
_PLATFORM_ALIASES = {"cuda": "gpu"}  # `lowering_platforms` spells the NVIDIA GPU "cuda"

# Both read when an op is called (under jit: traced), so a function jitted inside one of the
# contexts keeps the choice in its compiled form. Context variables: each thread starts without
# them, as with JAX's own configuration contexts.
_lowering_platform: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kernels_pallas_lowering_platform", default=None
)
_interpret: contextvars.ContextVar[Interpret] = contextvars.ContextVar(
    "kernels_pallas_interpret", default=None
)


def kernel_platform() -> str:
    """The platform kernels are built for: "cpu", "gpu" or "tpu"; JAX's default backend unless
    inside `lowering_for`."""
    return _lowering_platform.get() or jax.default_backend()


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[None]:
    """Builds kernels for `platform` ("cpu", "gpu" (or "cuda"), "tpu") inside the block, whatever
    the machine: for lowering on a CPU for another platform, e.g.

        with lowering_for("tpu"):
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    """
    name = _PLATFORM_ALIASES.get(platform, platform)
    if name not in PLATFORMS:
        raise ValueError(f"platform must be one of {[*PLATFORMS, 'cuda']}, got {platform!r}")
    token = _lowering_platform.set(name)
    try:
        yield
    finally:
        _lowering_platform.reset(token)


def native_lowering(platform: str | None = None) -> Lowering | None:
    """The lowering Pallas compiles through on `platform` (default `kernel_platform()`): Triton on
    a GPU, Mosaic on a TPU; None elsewhere (there Pallas only interprets)."""
    return NATIVE_LOWERING.get(platform or kernel_platform())


def on_gpu() -> bool:
    """True when kernels are built for a GPU (`kernel_platform()`)."""
    return kernel_platform() == "gpu"


def _check_interpret(interpret: Interpret) -> None:
    if interpret is not None and not isinstance(interpret, (bool, pltpu.InterpretParams)):
        raise ValueError(
            "interpret must be None, a bool or a jax.experimental.pallas.tpu.InterpretParams, "
            f"got {interpret!r}"
        )


@contextlib.contextmanager
def interpreting(interpret: bool | pltpu.InterpretParams = True) -> Iterator[None]:
    """Pallas interpretation for every op called inside the block without its own `interpret=`
    (the one way model-level code, e.g. a rollout with implementation "pallas", asks for it):
    True runs the Triton kernels in Pallas' generic interpreter, `pltpu.InterpretParams(...)` the
    Mosaic kernels in the TPU interpreter, False compiles natively. Read when an op is called:
    a function jitted inside the block keeps the choice in its compiled form."""
    _check_interpret(interpret)
    token = _interpret.set(interpret)
    try:
        yield
    finally:
        _interpret.reset(token)


class PallasUnavailableError(NotImplementedError):
    """A Pallas kernel asked for on a platform where Pallas does not compile, without
    interpretation (a NotImplementedError: an order ("pallas", "xla") moves on to XLA)."""


@dataclasses.dataclass(frozen=True)
class PallasTarget:
    """Which Pallas kernel of an op runs, and how.

    Attributes:
      lowering: TRITON (the op's `kernel.py`) or MOSAIC (its `mosaic.py`).
      interpret: what that kernel's `interpret=` gets: for TRITON a bool (True: Pallas' generic
        interpreter), for MOSAIC None (compiled for a TPU) or `pltpu.InterpretParams` (the TPU
        interpreter on the CPU).
    """

    lowering: Lowering
    interpret: bool | pltpu.InterpretParams | None

    @property
    def interpreted(self) -> bool:
        return self.interpret is not None and self.interpret is not False


def pallas_target(interpret: Interpret = None) -> PallasTarget:
    """The Pallas kernel an op runs for its `interpret=` argument.

    None: the `interpreting` context's choice if any, else native; False: native; True: the
    Triton kernel in Pallas' generic interpreter (Triton semantics, any platform);
    `pltpu.InterpretParams`: the Mosaic kernel in the TPU interpreter (Mosaic semantics on the
    CPU). Native is the Triton kernel where kernels are built for a GPU and the Mosaic kernel for
    a TPU; elsewhere it raises PallasUnavailableError naming the platform. Interpretation is
    never implied by the platform.
    """
    _check_interpret(interpret)
    if interpret is None:
        interpret = _interpret.get()
    if isinstance(interpret, pltpu.InterpretParams):
        return PallasTarget(Lowering.MOSAIC, interpret)
    if interpret:
        return PallasTarget(Lowering.TRITON, True)
    platform = kernel_platform()
    lowering = native_lowering(platform)
    if lowering is None:
        raise PallasUnavailableError(
            f"Pallas kernels compile on an NVIDIA GPU (Triton) or a TPU (Mosaic), not on platform "
            f"{platform!r}; to interpret them here pass interpret=True (the Triton kernels, "
            "generic interpreter) or interpret=jax.experimental.pallas.tpu.InterpretParams() (the "
            "Mosaic kernels, TPU semantics), or call inside kernels_pallas.common.interpreting(...)"
            "; to lower for another platform use kernels_pallas.common.lowering_for(...)"
        )
    return PallasTarget(lowering, False if lowering is Lowering.TRITON else None)


def implementation_order(
    implementation: ImplementationLike,
    choices: type[enum.StrEnum] = Implementation,
    native_order: tuple = NATIVE_ORDER,
) -> tuple:
    """The implementations an op tries, in order (members of `choices`).

    None: `native_order` where Pallas compiles natively (`native_lowering`: Triton on a GPU,
    Mosaic on a TPU), the XLA reference alone elsewhere, so the default runs everywhere
    (interpretation is asked for by name: `pallas_target`).
    A name: that implementation alone; where it cannot run, its NotImplementedError propagates.
    A sequence: each in turn, the next one tried when one raises NotImplementedError.
    """
    if implementation is None:
        return tuple(native_order) if native_lowering() else (choices("xla"),)
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    if not names:
        raise ValueError("implementation must not be an empty sequence")
    valid = [c.value for c in choices]
    for name in names:
        if name not in valid:
            raise ValueError(
                f"implementation must be None, one of {valid} or a sequence of them; got {name!r}"
            )
    return tuple(choices(name) for name in names)


def run_first[T](order: Sequence, runners: Mapping[Any, Callable[[], T]]) -> tuple[T, Any]:
    """Runs `runners[name]()` for each name of `order` until one returns (tokamax's fallback):
    returns (its result, its name). A NotImplementedError moves on to the next name; the last
    name's error propagates."""
    for i, name in enumerate(order):
        try:
            return runners[name](), name
        except NotImplementedError:
            if i == len(order) - 1:
                raise
    raise ValueError("implementation order is empty")


def mesh_split(
    lead: int | None = None,
) -> tuple[jax.sharding.AbstractMesh, tuple[str, ...], tuple[str, ...]]:
    """Where per-device code runs: (the context mesh (`jax.set_mesh`; an empty one without),
    its axes not manual yet (those a `jax.shard_map` inside the current one can still take),
    and those of them of size > 1, outermost first, whose sizes' product divides `lead`: the
    axes a leading axis of `lead` independent rows splits over; () for `lead` None)."""
    mesh = jax.sharding.get_abstract_mesh()
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    axes = tuple(a for a, kind in kinds.items() if kind != AxisType.Manual)
    split, size = [], 1
    if lead is not None:
        for a in axes:
            if mesh.shape[a] > 1 and lead % (size * mesh.shape[a]) == 0:
                split.append(a)
                size *= mesh.shape[a]
    return mesh, axes, tuple(split)


def per_device[T](fn: Callable[..., T], *args, split_leading: bool = False) -> T:
    """`fn(*args)`, a Pallas kernel call (Mosaic or Triton; pytrees of arrays in and out), once
    per device of the context mesh (`jax.set_mesh`) by `jax.shard_map` over its axes not manual
    yet; `fn(*args)` itself without a mesh of more than one device.

    GSPMD cannot partition a Pallas custom call: a Mosaic one fails to lower ("Mosaic kernels
    cannot be automatically partitioned"), a Triton one gets all-gathered operands and runs on
    the whole batch on every device. So on a mesh every Pallas kernel runs inside a shard_map.
    split_leading: every array of `args` has a leading axis of independent rows (a batch) of
      one size, split over the mesh axes whose sizes' product divides it (outermost first), the
      outputs' leading axis too; False: each device runs the whole op on gathered operands
      (grouped matmuls, whose groups span all rows).
    """
    mesh, axes, split = mesh_split()
    if math.prod(mesh.shape[a] for a in axes) <= 1:
        return fn(*args)
    if split_leading:
        leads = {a.shape[0] if a.ndim else None for a in jax.tree.leaves(args)}
        if len(leads) != 1 or None in leads:
            raise ValueError(f"split_leading needs one leading axis size, got sizes {leads}")
        (lead,) = leads
        split = mesh_split(lead)[2]
    spec = P(split) if split else P()
    return jax.shard_map(
        fn, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=frozenset(axes), check_vma=False
    )(*args)


def triton_params(num_warps: int = 4, num_stages: int = 2) -> pl_triton.CompilerParams:
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def scale_bits(scales: jax.Array) -> jax.Array:
    """Block scales (float8_e8m0fnu / float8_e4m3fn) as their uint8 bit patterns."""
    return jax.lax.bitcast_convert_type(scales, jnp.uint8)


def decode_scale_bits(bits: jax.Array, fmt: BlockFormat) -> jax.Array:
    """float32 block-scale values from uint8 bits, inside or outside a kernel."""
    return scale_bits_to_float32(bits, fmt)


def unpack_nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(low, high) 4-bit codes of packed bytes: elements 2i and 2i + 1 (see `fp4.pack_fp4`)."""
    p = packed.astype(jnp.int32)
    return p & 0xF, (p >> 4) & 0xF


# E2M1 code bits (s, e1, e0, m) moved to E4M3 bit positions (7, 4, 3, 2) give an E4M3 number equal
# to the E2M1 value times 2**-6 for all 16 codes, the subnormal 0.5 included (E4M3's exponent bias
# 7 exceeds E2M1's by 6, and its subnormal step 2**-9 is E2M1's 0.5 times 2**-6). So decoding is a
# few bitwise ops per packed byte plus the hardware FP8 -> bf16 conversion: no per-element compare
# or select chain, which is what makes FP4 decode cost more than its bytes on Hopper.
E4M3_ALIGN = 2.0**-6


def as_e4m3(bits: jax.Array) -> jax.Array:
    """uint8 E4M3 bit patterns as float8_e4m3fn (a bitcast)."""
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)


def e2m1_codes_as_e4m3(codes: jax.Array) -> jax.Array:
    """E2M1 codes (uint8, one per byte in the low nibble) as float8_e4m3fn, value * 2**-6."""
    return as_e4m3(((codes << 2) & 0x1C) | ((codes << 4) & 0x80))


def fp4_planes_as_e4m3(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(low, high) nibble planes of packed E2M1 bytes as float8_e4m3fn, each value * 2**-6.

    `packed` uint8 [..., n] (element 2i in the low nibble of byte i) -> two float8_e4m3fn [..., n]:
    the even and the odd elements. Exact: every E2M1 value times 2**-6 is an E4M3 number.
    """
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    # The low nibble's formula ignores bits 4-7, so it applies to the packed byte as is.
    return e2m1_codes_as_e4m3(packed), as_e4m3(((packed >> 2) & 0x1C) | (packed & 0x80))


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """float32 values of E2M1 codes (int), the quantizer's own decode."""
    return numerics.decode(codes, ElementType.E2M1.spec)


# E2M1 code bits (s, e1, e0, m) moved to float16 bit positions (15, 11, 10, 9) give a float16 equal
# to the E2M1 value times 2**-14 for all 16 codes (float16's exponent bias 15 exceeds E2M1's by 14;
# the subnormal 0.5 lands on float16's subnormal 2**-15). Unlike the E4M3 route this needs no
# conversion instruction at all: a packed byte becomes two float16 lanes by shifts and masks.
F16_ALIGN = 2.0**-14

# PTX for one 32-bit word of 4 packed bytes -> 4 float16 (two f16x2 registers), one plane. `prmt`
# spreads bytes (0, 1) and (2, 3) into the low bytes of the two 16-bit lanes; then for the low
# nibble (even elements) bits 0-2 go to 9-11 and bit 3 to 15, for the high nibble (odd elements)
# bits 4-6 go to 9-11 and bit 7 to 15. About 3 integer ops per element, whole words at a time.
_F16_PLANE_ASM = """{{
.reg .b32 a, b, t, u;
prmt.b32 a, $2, 0, 0x4140;
prmt.b32 b, $2, 0, 0x4342;
shl.b32 t, a, {mag_shift}; and.b32 t, t, 0x0E000E00;
shl.b32 u, a, {sign_shift}; and.b32 u, u, 0x80008000;
or.b32 $0, t, u;
shl.b32 t, b, {mag_shift}; and.b32 t, t, 0x0E000E00;
shl.b32 u, b, {sign_shift}; and.b32 u, u, 0x80008000;
or.b32 $1, t, u;
}}"""
_F16_PLANE_SHIFTS = ({"mag_shift": 9, "sign_shift": 12}, {"mag_shift": 5, "sign_shift": 8})


def fp4_planes_as_f16(
    packed: jax.Array, *, inline_asm: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(low, high) nibble planes of packed E2M1 bytes as float16, each value * 2**-14 (exact).

    `packed` uint8 [...] -> two float16 [...] (the even and the odd elements). `inline_asm=True`
    decodes whole 32-bit words with PTX (Triton lowering only: inside a Pallas kernel on an NVIDIA
    GPU; Triton pads a thread's elements to a multiple of 4); the default jnp form is the same bit
    mapping one element at a time (interpret mode, XLA, and the test reference of the PTX).
    """
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if inline_asm:
        return tuple(
            pl_triton.elementwise_inline_asm(
                _F16_PLANE_ASM.format(**shifts),
                args=[packed],
                constraints="=r,=r,r",
                pack=4,
                result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.float16)],
            )[0]
            for shifts in _F16_PLANE_SHIFTS
        )
    # The low nibble's mapping ignores bits 4-7, so it applies to the packed byte as is.
    p = packed.astype(jnp.uint16)
    odd = ((p & 0x70) << 5) | ((p & 0x80) << 8)
    return e2m1_codes_as_f16(packed), jax.lax.bitcast_convert_type(odd, jnp.float16)


def e2m1_codes_as_f16(codes: jax.Array) -> jax.Array:
    """E2M1 codes (uint8, one per byte in the low nibble; bits 4-7 ignored) as float16, value *
    2**-14 (exact): the low-nibble plane of `fp4_planes_as_f16`, for codes stored one per byte."""
    p = codes.astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(((p & 0x07) << 9) | ((p & 0x08) << 12), jnp.float16)


def rcp_approx(m: jax.Array) -> jax.Array:
    """`rcp.approx.ftz.f32` of float32 `m` (inline PTX: Triton lowering on an NVIDIA GPU only):
    one MUFU instruction within about an ulp, where a float32 division is `div.full.f32`'s range
    scaling and refinement. The estimate that `numerics.reciprocal_rn` corrects to the IEEE
    reciprocal (so the quantize kernel's bits do not depend on it)."""
    return pl_triton.elementwise_inline_asm(
        "rcp.approx.ftz.f32 $0, $1;",
        args=[m],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(m.shape, jnp.float32)],
    )[0]


def split_block_scales(
    bits: jax.Array, fmt: BlockFormat, global_scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Block scales as (per-element float16 factors, per-row float32 factors).

    bits uint8 [rows, NB] (and NVFP4's float32 global scale [rows]) -> (float16 [rows, NB],
    float32 [rows]) whose product is the block's full scale. float16 cannot hold every scale, so:
      NVFP4: the E4M3 block scale is exact in float16 and the row factor is the global scale; and
        code * scale * 2**-14 (`fp4_planes_as_f16` times this) is exact in float16 (a multiple of
        2**-24 below 0.17 with at most 6 significant bits).
      MXFP4: the row factor is the row's largest E8M0 scale and the element factor 2**(e - e_max)
        <= 1; blocks more than 2**-24 below their row's largest flush to zero in float16 (their
        products with 2**-14-aligned codes round below 2**-9): contributions under 2**-24 of the
        row's largest block.
    """
    if fmt.scale is ScaleType.E4M3:
        elem = as_e4m3(bits).astype(jnp.float16)
        row = jnp.ones(bits.shape[:1], jnp.float32) if global_scale is None else global_scale
        return elem, row.astype(jnp.float32)
    e = bits.astype(jnp.int32)
    e_max = e.max(axis=1)
    rel = e - e_max[:, None]  # <= 0
    rel_f32 = jax.lax.bitcast_convert_type((jnp.maximum(rel, -126) + 127) << 23, jnp.float32)
    elem = jnp.where(rel < -24, 0.0, rel_f32).astype(jnp.float16)
    return elem, numerics.decode_e8m0(e_max)


# ---------------------------------------------------------------------- flash attention bodies


def load_rows(ref, start, block_s: int, valid: jax.Array) -> jax.Array:
    """Rows [start, start + block_s) of a per-(b, h) ref [S, ...] (Triton lowering); rows not
    `valid` are not read and come back as zeros."""
    rows = pl.ds(start, block_s)
    zero = jnp.zeros((), ref.dtype)
    trailing = len(ref.shape) - 1
    mask = valid[(slice(None),) + (None,) * trailing]
    return pl_triton.load(ref.at[(rows,) + (slice(None),) * trailing], mask=mask, other=zero)


def online_softmax_step(m, total, s):
    """Running max `m` and sum `total` [rows] updated by block scores `s` -> (new max, the old
    terms' rescale alpha, probabilities p [rows, block_s] float32, new sum)."""
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    return m_new, alpha, p, alpha * total + p.sum(axis=1)
