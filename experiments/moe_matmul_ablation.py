r"""Where the FP4 MoE grouped matmul's decode time goes: kernel bodies cut down stage by stage.

At decode a grouped expert matmul should cost what reading the active experts' weights costs;
Nsight Compute does not run under JAX on the device machine, so cut-down kernels are timed side
by side. Every variant is a body of ONE launch (`run_case`): program (g, j, s) of grid (G,
N / block_n, split_k) multiplies expert g's 16-row activation tile (a decode step's rows of one
expert, padded to the smallest dot tile) by column tile j of its weights over its K range in
`block_k` steps into a float32 `[16, block_n]` accumulator, times a per-expert factor at the end.
NVFP4 random weights at the Qwen3-30B-A3B expert shape. The bodies (`VARIANTS`), each adding a
stage to the one before:

  stream    the packed weight bytes (uint8 `[block_n, block_k / 2]`) loaded and summed;
  decode    + the nibble planes as E4M3 -> bf16 (`common.fp4_planes_as_e4m3`), summed;
  dot       + the two bf16 dots with the even and odd activation columns (no scales);
  full      + the block scales (E4M3 -> bf16, times the planes): the product;
  f16       `full` with the float16 decode (`common.fp4_planes_as_f16`: shifts and masks, no
            convert), float16 scales, activations and dots;
  f16asm    `f16` with the decode in inline PTX on 32-bit words (interpret mode: the jnp form);
  stream32  `stream` over the same bytes as uint32 words `[block_n, block_k / 8]`;
  full32    `full` from uint32 words: eight nibble planes, eight dots of block_k / 8 each;
  bf16w     bf16 weights `[G, N, K]`, one dot a step: the twin every FP4 row is set against;
  f16asm_wl, bf16w_wl  `f16asm`, `bf16w` with the weights as the dots' left operand (accumulator
            `[block_n, rows]`): Hopper's wgmma reads its left operand from registers, its right
            one from shared memory, where decoded right-hand weights must go first.

Every variant runs every block config with the K offsets hinted aligned (`pl.multiple_of`);
`config.no_hints` variants again without hints, `config.split_k_variants` with K split over
`config.split_k` programs (partial sums added by XLA inside the timed call), and
`config.experts_per_program_variants` with each program walking `config.experts_per_program`
experts in turn. Each kernel is compiled and run once, timed in alternating rounds
(`timing.time_interleaved`), then inside one device loop of launches chained through the
activations (`timing.device_loop_times`: `loop_us`, below the host's per-call dispatch floor).
Per row: microseconds, the weight bytes the body reads (codes, plus block scales where read, or
bf16 weights) and GB/s, the byte limit at the read bandwidth measured in the run
(`harness.ceilings`) and the ratio to it, and the time over the bf16 twin's (same block and
split; median of per-round ratios). Each product variant is checked against the op's float32
reference (`fp4_moe_matmul_reference`) on the same packed weights; a relative error over
`REL_TOL` makes the row an error, untimed. Below the table: each variant's fastest row.

Writes `<outdir>/<name>.{md,json}`. What the H200 runs show: docs/kernels.md (fp4_moe_matmul).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental import pallas as pl
from ml_collections import ConfigDict

from experiments import harness, timing
from kernels_pallas.common import (
    E4M3_ALIGN,
    F16_ALIGN,
    as_e4m3,
    e2m1_codes_as_e4m3,
    fp4_planes_as_e4m3,
    fp4_planes_as_f16,
    scale_bits,
    triton_params,
)
from kernels_pallas.fp4_moe_matmul.reference import fp4_moe_matmul_reference, pack_weights
from trace_jax import fp4

FORMAT = fp4.NVFP4
SCALE_BLOCK = FORMAT.block_size  # weight elements per block scale, along K
MIN_DOT_DIM = 16  # Triton's smallest tensor-core tile edge for 16-bit dots
# Weight layouts: name -> weight elements per stored value. Also the number of activation planes:
# plane p holds the K columns p, p + P, ..., which meet the p-th element of every stored value.
WEIGHT_LAYOUTS = {"u8": 2, "u32": 8, "bf16": 1}
# A product variant's relative error against the float32 reference: exact bf16/float16 products
# accumulate in float32 (summation order only); any decode error is of order 1.
REL_TOL = 1e-4
BF16_TWIN = "bf16w"
LOOP_CALL_S = 50e-6  # a decode-size launch, to size the device loops
COLUMNS = ["variant", "hints", "split_k", "block", "us", "GBps", "bytes", "limit_us", "x_limit"]
COLUMNS += ["vs_bf16w", "loop_us", "loop_x_limit", "rel_err"]


@dataclasses.dataclass(frozen=True)
class KStep:
    """One program's K step at offset `k0`: a body's loads of its tiles (a body loads only what it
    reads). `planes`: `WEIGHT_LAYOUTS[layout]`; `hints`: whether offsets carry `pl.multiple_of`."""

    w_ref: object
    s_ref: object
    x_ref: object
    g: jax.Array
    rows: pl.Slice
    k0: jax.Array
    block_k: int
    planes: int
    hints: bool
    interpret: bool

    def cols(self, start, size: int) -> pl.Slice:
        """`size` columns from `start` (a multiple of `size`, hinted so where `hints`)."""
        return pl.ds(pl.multiple_of(start, size) if self.hints else start, size)

    def weights(self) -> jax.Array:
        """Expert g's weight tile `[block_n, block_k / planes]` (uint8, uint32 or bf16)."""
        per = self.block_k // self.planes
        return self.w_ref[self.g, :, self.cols(self.k0 // self.planes, per)]

    def scale_bits(self) -> jax.Array:
        """uint8 `[block_n, block_k / 16]`: the E4M3 block-scale bits of the weight tile."""
        nb = self.block_k // SCALE_BLOCK
        return self.s_ref[self.g, :, self.cols(self.k0 // SCALE_BLOCK, nb)]

    def x(self, plane: int) -> jax.Array:
        """Activation plane `plane` of the expert's rows, `[rows, block_k / planes]`."""
        per = self.block_k // self.planes
        return self.x_ref[plane, self.rows, self.cols(self.k0 // self.planes, per)]


# A body: (step, float32 accumulator [rows, block_n]) -> the accumulator after the step.
Body = Callable[[KStep, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Variant:
    """A kernel body and what it reads. `layout`: a `WEIGHT_LAYOUTS` name; `product`: the body
    computes the product (checked against the reference) once its accumulator is multiplied by
    `unscale` (the decode's power of two) and the expert's global scale; `dtype`: the activations'
    dtype (the dots' operand type)."""

    body: Body
    layout: str
    reads_scales: bool
    product: bool
    dtype: jnp.dtype = jnp.bfloat16
    unscale: float = 1.0
    weights_left: bool = False  # the accumulator is `[block_n, rows]`: weights the dots' LHS


def _row_sums(acc: jax.Array, tile: jax.Array) -> jax.Array:
    """`acc` plus the row sums of `tile` `[block_n, c]` (what keeps a body's values alive)."""
    return acc + tile.astype(jnp.float32).sum(axis=1)[None, :]


def _dots(step: KStep, planes, acc: jax.Array) -> jax.Array:
    """`acc` plus plane p of the activations times weight plane p (`[block_n, c]`), over p."""
    for p, w in enumerate(planes):
        acc = acc + jnp.dot(step.x(p), w.T, preferred_element_type=jnp.float32)
    return acc


def _dots_weights_left(step: KStep, planes, acc: jax.Array) -> jax.Array:
    """`_dots` transposed: `acc` `[block_n, rows]` plus weight plane p times activation plane p
    transposed. The weights are the dots' left operand, which Hopper's wgmma can take from
    registers (the right one it reads from shared memory): decoded weights need not make a
    round trip through shared memory to reach the tensor cores."""
    for p, w in enumerate(planes):
        acc = acc + jnp.dot(w, step.x(p).T, preferred_element_type=jnp.float32)
    return acc


def _e4m3_planes(step: KStep) -> list[jax.Array]:
    """Even and odd weight columns, bf16 `[block_n, block_k / 2]` each, value * 2**-6."""
    return [p.astype(jnp.bfloat16) for p in fp4_planes_as_e4m3(step.weights())]


def _word_planes(step: KStep) -> list[jax.Array]:
    """Eight weight planes from uint32 words, bf16 `[block_n, block_k / 8]` each, value * 2**-6:
    nibble j of word c is element 8c + j (bytes little-endian, element 2i in byte i's low half)."""
    words = step.weights()
    nibbles = [(words >> (4 * j)).astype(jnp.uint8) for j in range(8)]  # the bits above ignored
    return [e2m1_codes_as_e4m3(c).astype(jnp.bfloat16) for c in nibbles]


def _block_scales(step: KStep, dtype) -> jax.Array:
    """The tile's block scales in `dtype`, one per column of a plane, `[block_n, block_k /
    planes]` (exact: E4M3 values fit bf16 and float16)."""
    s = as_e4m3(step.scale_bits()).astype(dtype)
    rows, nb = s.shape
    per_block = SCALE_BLOCK // step.planes  # a plane's columns under one block scale
    return jnp.broadcast_to(s[:, :, None], (rows, nb, per_block)).reshape(rows, nb * per_block)


def _stream(step, acc):
    return _row_sums(acc, step.weights())


def _decode(step, acc):
    even, odd = _e4m3_planes(step)
    return _row_sums(acc, even + odd)


def _dot(step, acc):
    return _dots(step, _e4m3_planes(step), acc)


def _full(step, acc):
    scales = _block_scales(step, jnp.bfloat16)
    return _dots(step, [p * scales for p in _e4m3_planes(step)], acc)


def _f16(inline_asm: bool, weights_left: bool = False) -> Body:
    dots = _dots_weights_left if weights_left else _dots

    def body(step, acc):
        asm = inline_asm and not step.interpret  # PTX lowers through Triton only
        planes = fp4_planes_as_f16(step.weights(), inline_asm=asm)  # value * 2**-14
        scales = _block_scales(step, jnp.float16)
        # code * scale * 2**-14 is exact in float16 (`common.split_block_scales`).
        return dots(step, [p * scales for p in planes], acc)

    return body


def _full32(step, acc):
    scales = _block_scales(step, jnp.bfloat16)
    return _dots(step, [p * scales for p in _word_planes(step)], acc)


def _bf16w(step, acc):
    return _dots(step, [step.weights()], acc)


def _bf16w_left(step, acc):
    return _dots_weights_left(step, [step.weights()], acc)


VARIANTS: dict[str, Variant] = {
    "stream": Variant(_stream, "u8", reads_scales=False, product=False),
    "decode": Variant(_decode, "u8", reads_scales=False, product=False),
    "dot": Variant(_dot, "u8", reads_scales=False, product=False),
    "full": Variant(_full, "u8", reads_scales=True, product=True, unscale=1 / E4M3_ALIGN),
    "f16": Variant(_f16(False), "u8", True, True, dtype=jnp.float16, unscale=1 / F16_ALIGN),
    "f16asm": Variant(_f16(True), "u8", True, True, dtype=jnp.float16, unscale=1 / F16_ALIGN),
    "stream32": Variant(_stream, "u32", reads_scales=False, product=False),
    "full32": Variant(_full32, "u32", reads_scales=True, product=True, unscale=1 / E4M3_ALIGN),
    BF16_TWIN: Variant(_bf16w, "bf16", reads_scales=False, product=False),
    # The same two with the weights as the dots' left operand (`_dots_weights_left`).
    "f16asm_wl": Variant(
        _f16(True, weights_left=True), "u8", True, True, dtype=jnp.float16,
        unscale=1 / F16_ALIGN, weights_left=True,
    ),
    "bf16w_wl": Variant(_bf16w_left, "bf16", False, False, weights_left=True),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed kernel: a variant over a block config, with or without alignment hints, with K
    split over `split_k` programs."""

    variant: str
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    hints: bool = True
    split_k: int = 1
    experts_per_program: int = 1

    @property
    def block(self) -> str:
        e = f" e{self.experts_per_program}" if self.experts_per_program > 1 else ""
        return f"bn{self.block_n} bk{self.block_k} w{self.num_warps} s{self.num_stages}{e}"

    @property
    def label(self) -> str:
        return f"{self.variant} {self.block} hints={self.hints} split_k={self.split_k}"

    def twin(self) -> Case:
        """The bf16-weights case this one is compared with: same block, split and experts per
        program, with hints."""
        return dataclasses.replace(self, variant=BF16_TWIN, hints=True)


def check_case(case: Case, g: int, k: int, n: int) -> None:
    """Raises ValueError unless the case's tiles fit `[G, N, K]` and the tensor cores."""
    planes = WEIGHT_LAYOUTS[VARIANTS[case.variant].layout]
    if n % case.block_n:
        raise ValueError(f"block_n={case.block_n} must divide N={n}")
    if g % case.experts_per_program:
        raise ValueError(f"experts_per_program={case.experts_per_program} must divide G={g}")
    if k % (case.block_k * case.split_k):
        raise ValueError(f"block_k={case.block_k} x split_k={case.split_k} must divide K={k}")
    if case.block_k % SCALE_BLOCK or case.block_k // planes < MIN_DOT_DIM:
        raise ValueError(
            f"block_k={case.block_k} must be a multiple of {SCALE_BLOCK} (the scale block) and "
            f"give each of the {planes} planes of {case.variant!r} >= {MIN_DOT_DIM} columns"
        )


@functools.partial(jax.jit, static_argnames=("case", "interpret"))
def run_case(weights, s_bits, x_planes, out_scale, *, case: Case, interpret: bool) -> jax.Array:
    """The shared launch with `case`'s body -> float32 `[G * R, N]` (the product for a product
    variant; what keeps the work alive otherwise).

    weights: `[G, N, K / P]` in the variant's layout (P = `WEIGHT_LAYOUTS[layout]`); s_bits:
    uint8 `[G, N, K / 16]`; x_planes: `[P, G * R, K / P]` in the variant's dtype, expert g's rows
    `[g * R, (g + 1) * R)`; out_scale: float32 `[G]`, the factor of each expert's output.
    """
    variant = VARIANTS[case.variant]
    g, n, _ = weights.shape
    planes, gr, k_plane = x_planes.shape
    k, r = k_plane * planes, gr // g
    check_case(case, g, k, n)
    bn, bk, splits, epp = case.block_n, case.block_k, case.split_k, case.experts_per_program
    k_split = k // splits

    def kernel(w_ref, s_ref, x_ref, f_ref, o_ref):
        k_base = pl.program_id(2) * k_split
        first = pl.program_id(0) * epp  # read outside the loop: interpret mode needs it there

        def expert(e, carry):
            gi = first + e
            row0 = gi * r
            rows = pl.ds(pl.multiple_of(row0, r) if case.hints else row0, r)

            def k_step(kk, acc):
                k0 = k_base + kk * bk
                step = KStep(w_ref, s_ref, x_ref, gi, rows, k0, bk, planes, case.hints, interpret)
                return variant.body(step, acc)

            shape = (bn, r) if variant.weights_left else (r, bn)
            acc = jax.lax.fori_loop(0, k_split // bk, k_step, jnp.zeros(shape, jnp.float32))
            o_ref[0, rows, :] = (acc.T if variant.weights_left else acc) * f_ref[gi]
            return carry

        if epp == 1:  # no expert loop: the production kernel's program
            expert(0, 0)
        else:
            jax.lax.fori_loop(0, epp, expert, 0)

    def panel(a):  # expert-major [G, N, ...]: all experts' rows of column tile j
        return pl.BlockSpec((g, bn, a.shape[2]), lambda i, j, s: (0, j, 0))

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, gr, n), jnp.float32),
        grid=(g // epp, n // bn, splits),
        in_specs=[
            panel(weights),
            panel(s_bits),
            pl.BlockSpec(x_planes.shape, lambda i, j, s: (0, 0, 0)),
            pl.BlockSpec((g,), lambda i, j, s: (0,)),
        ],
        out_specs=pl.BlockSpec((1, gr, bn), lambda i, j, s: (s, 0, j)),
        compiler_params=triton_params(case.num_warps, case.num_stages),
        interpret=interpret,
        name=f"moe_ablation_{case.variant}",
    )(weights, s_bits, x_planes, out_scale)
    return out.sum(axis=0) if splits > 1 else out[0]


def cases(config: ConfigDict) -> list[Case]:
    """Every variant at every block config; the `no_hints` variants again without hints; the
    `split_k_variants` at each K split of `split_k` and the `experts_per_program_variants` at
    each of `experts_per_program`, at the first block config."""
    epp_variants = config.experts_per_program_variants
    for name in (*config.variants, *config.no_hints, *config.split_k_variants, *epp_variants):
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; expected one of {sorted(VARIANTS)}")
    if not config.block_configs:
        raise ValueError("config.block_configs must name at least one block config")
    out = []
    for block in config.block_configs:
        out += [Case(v, *block) for v in config.variants]
        out += [Case(v, *block, hints=False) for v in config.no_hints]
    first = config.block_configs[0]
    out += [Case(v, *first, split_k=s) for s in config.split_k for v in config.split_k_variants]
    out += [
        Case(v, *first, experts_per_program=e)
        for e in config.experts_per_program
        for v in epp_variants
    ]
    return out


class Operands:
    """The random operands of one run, each layout built once: NVFP4 weights packed by the op's
    own `pack_weights` (their bf16 twin: the same random values in bf16), activations bf16
    `[G * R, K]`."""

    def __init__(self, config: ConfigDict):
        g, k, n, r = config.experts, config.d_model, config.d_ff, config.rows_per_expert
        w = jax.random.normal(jax.random.key(7), (g, n, k), jnp.float32) * 0.02
        self.packed = jax.jit(pack_weights, static_argnums=1)(w, FORMAT)
        self.w_bf16 = w.astype(jnp.bfloat16)
        self.x = jax.random.normal(jax.random.key(8), (g * r, k), jnp.bfloat16)
        self.group_sizes = jnp.full((g,), r, jnp.int32)
        self.shape = (g, k, n, r)
        self.built: dict = {}  # (layout, dtype, unscale) -> `args`' tuple

    def weights(self, layout: str) -> jax.Array:
        g, k, n, _ = self.shape
        if layout == "u8":
            return self.packed.codes
        if layout == "u32":  # the same bytes, 4 to a word
            words = self.packed.codes.reshape(g, n, k // 8, 4)
            return jax.lax.bitcast_convert_type(words, jnp.uint32)
        return self.w_bf16

    def args(self, variant: Variant) -> tuple:
        """(weights, s_bits, x_planes, out_scale) of `run_case` for `variant`."""
        key = (variant.layout, jnp.dtype(variant.dtype).name, variant.unscale)
        if key not in self.built:
            planes = WEIGHT_LAYOUTS[variant.layout]
            m, k = self.x.shape
            x_planes = jnp.moveaxis(self.x.reshape(m, k // planes, planes), -1, 0)
            if variant.layout == "bf16":
                out_scale = jnp.ones((self.shape[0],), jnp.float32)
            else:
                out_scale = self.packed.global_scale.reshape(-1) * variant.unscale
            self.built[key] = (
                self.weights(variant.layout),
                scale_bits(self.packed.scales),
                x_planes.astype(variant.dtype),
                out_scale,
            )
        return self.built[key]

    def bytes_read(self, variant: Variant) -> int:
        """The weight bytes `variant`'s body reads."""
        if variant.layout == "bf16":
            return harness.nbytes(self.w_bf16)
        return harness.nbytes(self.packed.codes, *([self.packed.scales] * variant.reads_scales))

    def reference(self) -> jax.Array:
        """float32 `[G * R, N]`: the op's XLA reference on the packed weights."""
        return fp4_moe_matmul_reference(
            self.x, self.packed, self.group_sizes, out_dtype=jnp.float32
        )


def bench(config: ConfigDict) -> tuple[list[dict], dict]:
    """Every case of `cases(config)` -> (rows, the run's ceilings). A case that fails to lower,
    compile or run, or a product off the reference, is a row with its error; the others are
    timed together."""
    smoke, interpret = config.smoke, jax.default_backend() != "gpu"
    ceil = harness.ceilings(config.ceiling_bytes, smoke=smoke)
    ops = Operands(config)
    want = ops.reference()
    todo = cases(config)
    ready, rel_errs, errors = {}, {}, {}
    for case in todo:
        variant = VARIANTS[case.variant]
        args = ops.args(variant)
        try:
            compiled = run_case.lower(*args, case=case, interpret=interpret).compile()
            got = jax.block_until_ready(compiled(*args))
            if variant.product:
                rel_errs[case] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                if not rel_errs[case] <= REL_TOL:  # NaN fails too
                    err = f"relative error {rel_errs[case]:.3g} (expected <= {REL_TOL})"
                    raise AssertionError(f"{case.label} differs from the reference by {err}")
        except Exception as e:  # a body Triton cannot lower must not lose the other rows
            logging.exception("%s failed", case.label)
            errors[case] = repr(e)[:300]
            continue
        ready[case] = (compiled, args)
        logging.info("compiled %s", case.label)
    rounds = dict(rounds=1, inner=1, trials=1, warmup=1) if smoke else dict(rounds=config.rounds)
    labelled = {c.label: f for c, f in ready.items()}
    timed = timing.time_interleaved(labelled, **rounds) if ready else {}
    by_round = {c: timed[c.label] for c in ready}
    loop_us = {}
    if config.loop_seconds and ready:  # each launch again, chained through the activations
        calls = {c: (functools.partial(run_case, case=c, interpret=interpret), a)
                 for c, (_, a) in ready.items()}  # fmt: skip
        loop_s = timing.device_loop_times(  # the floor carries the activation planes
            calls, next(iter(calls.values()))[1][2], loop_seconds=config.loop_seconds,
            unroll=config.loop_unroll,
            per_call_s=LOOP_CALL_S, carry_arg=2, smoke=smoke,
        )  # fmt: skip
        loop_us = {c: 1e6 * t for c, t in loop_s.items()}
    rows = []
    for case in todo:
        row = {**dataclasses.asdict(case), "block": case.block}
        if case in errors:
            rows.append({**row, "error": errors[case]})
            continue
        t = statistics.median(by_round[case])
        nbytes = ops.bytes_read(VARIANTS[case.variant])
        limit_s = nbytes / ceil["read_bw"]
        row |= {"us": 1e6 * t, "GBps": nbytes / t / 1e9, "bytes": nbytes}
        row |= {"limit_us": 1e6 * limit_s, "x_limit": t / limit_s}
        if case.variant != BF16_TWIN and case.twin() in by_round:
            pairs = zip(by_round[case], by_round[case.twin()], strict=True)
            row["vs_bf16w"] = statistics.median(a / b for a, b in pairs)
        if case in loop_us:
            row["loop_us"] = loop_us[case]
            row["loop_x_limit"] = loop_us[case] / row["limit_us"]
        if case in rel_errs:
            row["rel_err"] = rel_errs[case]
        rows.append(row)
        logging.info("%s", row)
    if loop_us:
        ceil = {**ceil, "loop_floor_us": loop_us[timing.LOOP_FLOOR]}
    return rows, ceil


def best_by_variant(rows: list[dict]) -> list[dict]:
    """Each variant's fastest timed row (over block configs, hints and K splits), with its time
    over the fastest bf16-weights row's (medians, not paired: they may come from other blocks)."""
    best: dict[str, dict] = {}
    for r in rows:
        if "us" in r and (r["variant"] not in best or r["us"] < best[r["variant"]]["us"]):
            best[r["variant"]] = r
    keys = ("variant", "block", "hints", "split_k", "us", "x_limit")
    out = [{k: r[k] for k in keys} for r in best.values()]
    if BF16_TWIN in best:
        for r in out:
            r["vs_best_bf16w"] = r["us"] / best[BF16_TWIN]["us"]
    return out


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Times every case and writes `<outdir>/<name>.{md,json}` (the rows, the ceilings, the
    shape and `best_by_variant`); returns the rows."""
    rows, ceil = bench(config)
    best = best_by_variant(rows)
    best_cols = ["variant", "block", "hints", "split_k", "us", "x_limit", "vs_best_bf16w"]
    cols = COLUMNS + (["error"] if any("error" in r for r in rows) else [])
    shape = {"experts": config.experts, "d_model": config.d_model, "d_ff": config.d_ff,
             "rows_per_expert": config.rows_per_expert, "format": FORMAT.name}  # fmt: skip
    table = harness.write_table(
        name,
        rows,
        cols,
        title="FP4 MoE grouped matmul at decode, cut down to kernel bodies",
        notes=(
            f"G{config.experts} K{config.d_model} N{config.d_ff}, {config.rows_per_expert} rows "
            f"per expert, {FORMAT.name} weights; one body per row (module docstring). `bytes`: "
            f"weight bytes read; `limit_us`: at {ceil['read_bw'] / 1e9:.0f} GB/s (this run); "
            "`x_limit`: us / limit_us; `vs_bf16w`: over the bf16 twin (median of per-round "
            "ratios); `loop_us`: inside a device loop (no host dispatch; the loop's own cost, "
            "`loop_floor_us`, in the JSON's ceilings); `rel_err`: against the XLA reference."
            + (harness.SMOKE_NOTE if config.smoke else "")
            + "\n\nEach variant's fastest row:\n\n"
            + harness.markdown_table(best, best_cols)
        ),
        outdir=outdir,
        extra={"ceilings": ceil, "shape": shape, "best_by_variant": best},
    )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="moe_matmul_ablation", name="moe_matmul_ablation")
