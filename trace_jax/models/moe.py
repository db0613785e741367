"""Top-k softmax router, Switch load-balancing loss and SwiGLU routed experts (grouped and dense).

Axis legend (einsum letters in parentheses): B batch (b), T time (t), D model (d), E experts (e),
K top-k slots (k), F expert ffn width (f), M = B*T*K (token, slot) assignments (m).

The routed experts run grouped: the M assignments are sorted by expert and each projection is one
grouped matmul over the E contiguous groups (`jax.lax.ragged_dot`, or its tiled XLA form:
`ModelConfig.grouped_matmul`, `grouped_matmul.py`). `experts_dense` is the reference (every token
through every expert, masked combine); both call the "expert_mid" site on the same [B, T, K, F]
tensor in (token, slot) order, so they agree for any site.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kernels_pallas import common
from kernels_pallas.fp4_moe_matmul import (
    PackedFP4Weights,
    fp4_moe_matmul,
    pack_weights,
    predecode_pays,
)
from trace_jax import fp4
from trace_jax.models.backends import expert_kernel_order, site_implementation
from trace_jax.models.config import (
    ModelConfig,
    QuantSite,
    SiteName,
    identity_site,
    site_records,
    take_written_records,
)
from trace_jax.models.grouped_matmul import GroupedMatmul, grouped_dot

# The data-parallel axis (`trace_jax.rl.sharding.MESH_AXES`): batch rows split over it,
# parameters replicated along it.
DATA_AXIS = "data"


class MoEImpl(enum.StrEnum):
    """How routed experts are computed: GROUPED (ragged_dot, the default) or DENSE (reference)."""

    GROUPED = "grouped"
    DENSE = "dense"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Router decisions of one layer.

    topk_idx [B, T, K] int32: the experts used (the router's top-k, or replayed choices).
    topk_weights [B, T, K] float32: their combine weights (softmax probabilities at topk_idx,
      renormalized to sum to one when `norm_topk_prob`).
    probs [B, T, E] float32: the softmax over all experts.
    """

    topk_idx: jax.Array
    topk_weights: jax.Array
    probs: jax.Array


def route(
    logits: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool,
    expert_choices: jax.Array | None = None,
) -> Routing:
    """Softmax over all E experts of `logits [B, T, E]`, then top-k (or `expert_choices`).

    With `expert_choices [B, T, K]` (routing replay) those indices are used instead of the top-k;
    the weights are always the softmax probabilities gathered at the used indices, so replaying the
    router's own choices reproduces its weights bit for bit.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if expert_choices is None:
        _, idx = jax.lax.top_k(probs, top_k)
    else:
        if expert_choices.shape != (*logits.shape[:-1], top_k):
            raise ValueError(
                f"expert_choices has shape {expert_choices.shape}, expected "
                f"{(*logits.shape[:-1], top_k)} [B, T, K]"
            )
        idx = expert_choices
    idx = idx.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, idx, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(topk_idx=idx, topk_weights=weights, probs=probs)


def switch_aux_loss(routing: Routing, valid: jax.Array | None = None) -> jax.Array:
    """Switch load-balancing loss `E * sum_e f_e * P_e` over the valid tokens (scalar float32).

    f_e: fraction of valid tokens' assignments, summed over the K slots, that go to expert e
    (so a uniform router gives K); P_e: mean router probability of e. Same as Hugging Face's
    `load_balancing_loss_func` for one layer. `valid [B, T]` bool (default: all tokens).
    """
    n_experts = routing.probs.shape[-1]
    if valid is None:
        valid = jnp.ones(routing.probs.shape[:-1], jnp.bool_)
    w = valid.astype(jnp.float32)  # [B, T]
    n_valid = jnp.maximum(jnp.sum(w), 1.0)
    assigned = jax.nn.one_hot(routing.topk_idx, n_experts, dtype=jnp.float32)  # [B, T, K, E]
    f = jnp.einsum("btke,bt->e", assigned, w) / n_valid
    p = jnp.einsum("bte,bt->e", routing.probs, w) / n_valid
    return n_experts * jnp.sum(f * p)


def router_logits(x: jax.Array, router: jax.Array, dtype) -> jax.Array:
    """Router logits of `x [B, T, D]` by `router [D, E]`: [B, T, E] float32 (matmul in the
    compute `dtype`, float32 accumulation)."""
    return jnp.einsum(
        "btd,de->bte", x.astype(dtype), router.astype(dtype), preferred_element_type=jnp.float32
    )


def _swap_last(w: jax.Array) -> jax.Array:
    return jnp.swapaxes(w, -1, -2)


def _sort_by_expert(routing: Routing, n_experts: int):
    """(order, inverse, group_sizes): the M = B*T*K assignments sorted by expert (stable)."""
    m = routing.topk_idx.size
    flat_e = routing.topk_idx.reshape(m)
    order = jnp.argsort(flat_e, stable=True)  # sorted row -> (token, slot) row
    inverse = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32))
    group_sizes = jnp.bincount(flat_e, length=n_experts).astype(jnp.int32)  # [E]
    return order, inverse, group_sizes


def _combine(y_sorted: jax.Array, inverse: jax.Array, routing: Routing, dtype) -> jax.Array:
    """Expert outputs [M, D] in sorted order -> [B, T, D]: the top-k weighted sum per token."""
    b, t, top_k = routing.topk_idx.shape
    y = y_sorted[inverse].reshape(b, t, top_k, y_sorted.shape[-1])
    out = jnp.einsum(
        "btkd,btk->btd", y, routing.topk_weights.astype(y.dtype), preferred_element_type=jnp.float32
    )
    return out.astype(dtype)


def experts_grouped(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    routing: Routing,
    *,
    layer: int,
    site: QuantSite = identity_site,
    matmul: GroupedMatmul | str = GroupedMatmul.RAGGED_DOT,
) -> jax.Array:
    """Routed SwiGLU experts by sorted assignments and a grouped matmul (`matmul`: `ragged_dot`
    or the tiled form, `grouped_matmul.grouped_dot`); returns [B, T, D] in x.dtype.

    x [B, T, D] (already through the "expert_in" site); w_gate, w_up [E, F, D]; w_down [E, D, F]
    (contraction dim last, already through their sites). `site` is used for "expert_mid" only.
    """
    b, t, d = x.shape
    top_k = routing.topk_idx.shape[-1]
    m = b * t * top_k
    order, inverse, group_sizes = _sort_by_expert(routing, w_gate.shape[0])
    x_sorted = x.reshape(b * t, d)[order // top_k]  # [M, D]
    gate = grouped_dot(x_sorted, _swap_last(w_gate), group_sizes, matmul)  # [M, F]
    up = grouped_dot(x_sorted, _swap_last(w_up), group_sizes, matmul)
    h = jax.nn.silu(gate) * up  # [M, F] expert-sorted
    if site is not identity_site:  # the site sees (token, slot) order; skip two gathers if no-op
        f = h.shape[-1]
        h_tok = h[inverse].reshape(b, t, top_k, f)
        h_tok = site(h_tok, name=SiteName.EXPERT_MID, layer=layer, experts=routing.topk_idx)
        h = h_tok.reshape(m, f)[order]
    y_sorted = grouped_dot(h, _swap_last(w_down), group_sizes, matmul)  # [M, D]
    return _combine(y_sorted, inverse, routing, x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """One layer's routed-expert weights, FP4-quantized (RTN, one global scale per expert as at
    the weight sites) and packed for the Pallas MoE kernel: `PackedFP4Weights` gate, up
    [E, F, D] and down [E, D, F]."""

    gate: PackedFP4Weights
    up: PackedFP4Weights
    down: PackedFP4Weights


def _rows(q, rows: jax.Array):
    """Rows `rows` of a site output flattened to [R, N]: a `QTensor` (codes, scales, global
    scale gathered together) or a plain array (cast to bfloat16, the kernel's plain operand)."""
    if isinstance(q, fp4.QTensor):
        codes, scales = (a.reshape(-1, a.shape[-1])[rows] for a in (q.codes, q.scales))
        gs = None if q.global_scale is None else q.global_scale.reshape(-1, 1)[rows]
        return fp4.QTensor(codes, scales, gs, q.fmt)
    return q.reshape(-1, q.shape[-1])[rows].astype(jnp.bfloat16)


def experts_packed_fp4(
    x_q,
    packed: PackedExperts,
    routing: Routing,
    *,
    layer: int,
    site: QuantSite,
    dtype,
    predecode: bool | None = None,
) -> jax.Array:
    """`experts_grouped` on packed FP4 weights with the Pallas FP4 MoE matmul (rollout only).

    x_q: the "expert_in" site's `QTensor` [B, T, D] (or the plain activations when that site does
    not quantize); `site` must offer `quantized` (a `QuantSites`) for "expert_mid". The kernel
    decodes both operands exactly and accumulates in float32 like `ragged_dot` over the
    fake-quantized values, so the two paths agree to summation order. The implementations tried
    are `expert_kernel_order`'s (cuDNN's block-scaled matmul first on Blackwell GPUs).
    `predecode`: `ModelConfig.predecode_experts` (None: the op's default; True: the weights
    decoded before the call where `predecode_pays` for these rows; False: never). Returns
    [B, T, D] in dtype.
    """
    b, t, top_k = routing.topk_idx.shape
    n_experts = packed.gate.shape[0]
    order, inverse, group_sizes = _sort_by_expert(routing, n_experts)
    implementation = expert_kernel_order(site_implementation(site))
    if predecode:
        predecode = predecode_pays(b * t * top_k, n_experts)

    def matmul(lhs, w):
        return fp4_moe_matmul(
            lhs, w, group_sizes, implementation=implementation, predecode=predecode,
            out_dtype=dtype,
        )  # fmt: skip

    x_sorted = _rows(x_q, order // top_k)  # [M, D]
    h = jax.nn.silu(matmul(x_sorted, packed.gate)) * matmul(x_sorted, packed.up)  # [M, F]
    h_tok = h[inverse].reshape(b, t, top_k, h.shape[-1])
    h_val, h_q = site.quantized(
        h_tok, name=SiteName.EXPERT_MID, layer=layer, experts=routing.topk_idx
    )
    y_sorted = matmul(_rows(h_val if h_q is None else h_q, order), packed.down)  # [M, D]
    return _combine(y_sorted, inverse, routing, dtype)


def data_parallel_mesh(rows: int) -> jax.sharding.AbstractMesh | None:
    """The context mesh (`common.mesh_split`, as the Pallas kernels find theirs) when it is a
    data-parallel one for `rows` batch rows: its only axis of size > 1 not manual yet is
    `DATA_AXIS`, whose size divides `rows`; None otherwise (no mesh, one device, an fsdp or
    expert axis, whose weights are split, or rows that do not divide)."""
    mesh, axes, split = common.mesh_split(rows)
    if [a for a in axes if mesh.shape[a] > 1] != [DATA_AXIS] or split != (DATA_AXIS,):
        return None
    return mesh


def rows_per_device[R, S, O](fn: Callable[[R, S], O], rows: R, shared: S, *, site: QuantSite) -> O:
    """`fn(rows, shared)` once per device of a data-parallel mesh (`data_parallel_mesh`) on that
    device's rows, in a `jax.shard_map`: `rows` (a pytree of [B, ...] arrays) and the outputs
    split by their leading axis over `DATA_AXIS`, `shared` (weights) replicated. For `fn`s whose
    rows do not interact (the MoE's routing, grouped experts and combine: `MoE.__call__`), the
    values are those of the unsharded call bit for bit, without a collective; GSPMD would route
    all rows together (all-gathers of router probabilities, expert ids and rows, all-reduces of
    group sizes, every layer). Without such a mesh: `fn(rows, shared)`.

    What `site` records inside (the "expert_mid" captures, [B, T, K, ...]) leaves the shard_map
    split by rows (`take_written_records`); a site whose records reduce over rows (statistics,
    coverage: `records_per_row` False) keeps the GSPMD path.
    """
    mesh = data_parallel_mesh(jax.tree.leaves(rows)[0].shape[0])
    if mesh is None or not getattr(site, "records_per_row", True):
        return fn(rows, shared)
    records = site_records(site)
    before = {name: dict(d) for name, d in records.items()}

    def local(rows, shared):
        out = fn(rows, shared)
        return out, take_written_records(records, before)

    split = P(DATA_AXIS)
    _, axes, _ = common.mesh_split()
    out, written = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(split, P()),
        out_specs=(split, split),
        axis_names=frozenset(axes),
        check_vma=False,
    )(rows, shared)
    for name, entries in written.items():
        records[name].update(entries)
    return out


def pack_experts(moe: MoE, qcfg, dtype) -> PackedExperts:
    """Quantizes and packs one MoE layer's expert weights exactly as the weight sites quantize
    them (the weights cast to the compute dtype `dtype`, RTN, one global scale per expert)."""

    def pack(w, name):
        return pack_weights(w[...].astype(dtype), qcfg.format_for(name))

    return PackedExperts(
        pack(moe.w_gate, SiteName.W_GATE),
        pack(moe.w_up, SiteName.W_UP),
        pack(moe.w_down, SiteName.W_DOWN),
    )


def experts_dense(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    routing: Routing,
    *,
    layer: int,
    site: QuantSite = identity_site,
) -> jax.Array:
    """Reference of `experts_grouped`: every token through every expert, masked combine."""
    n_experts = w_gate.shape[0]
    gate = jnp.einsum("btd,efd->btef", x, w_gate)
    up = jnp.einsum("btd,efd->btef", x, w_up)
    h = jax.nn.silu(gate) * up  # [B, T, E, F]
    onehot = jax.nn.one_hot(routing.topk_idx, n_experts, dtype=h.dtype)  # [B, T, K, E]
    if site is not identity_site:
        h_sel = jnp.take_along_axis(h, routing.topk_idx[..., None], axis=2)  # [B, T, K, F]
        h_sel = site(h_sel, name=SiteName.EXPERT_MID, layer=layer, experts=routing.topk_idx)
        keep = 1 - jnp.sum(onehot, axis=2)  # [B, T, E]: 0 on selected experts
        h = h * keep[..., None] + jnp.einsum("btke,btkf->btef", onehot, h_sel)
    y = jnp.einsum("btef,edf->bted", h, w_down)  # [B, T, E, D]
    combine = jnp.einsum("btke,btk->bte", onehot.astype(jnp.float32), routing.topk_weights)
    out = jnp.einsum(
        "bted,bte->btd", y, combine.astype(y.dtype), preferred_element_type=jnp.float32
    )
    return out.astype(x.dtype)


class SwiGLU(nnx.Module):
    """A dense SwiGLU MLP: w_gate, w_up [D, F], w_down [F, D] (the shared expert)."""

    def __init__(self, d_model: int, d_ff: int, cfg: ModelConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        self.w_gate = nnx.Param(init(rngs.params(), (d_model, d_ff), cfg.param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (d_model, d_ff), cfg.param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (d_ff, d_model), cfg.param_dtype))
        self.dtype = cfg.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, D] in the compute dtype."""
        dt = self.dtype
        x = x.astype(dt)
        gate = jnp.einsum("btd,df->btf", x, self.w_gate[...].astype(dt))
        up = jnp.einsum("btd,df->btf", x, self.w_up[...].astype(dt))
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.w_down[...].astype(dt))


class MoE(nnx.Module):
    """Router + routed SwiGLU experts (+ optional shared expert with a sigmoid gate).

    Weights: router [D, E]; w_gate, w_up [E, F, D]; w_down [E, D, F] (the Hugging Face per-expert
    layout, contraction dim last); shared: SwiGLU [D, Fs] or None; shared_gate [D] or None.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        e, d, f, pd = cfg.n_experts, cfg.d_model, cfg.d_ff_expert, cfg.param_dtype
        self.router = nnx.Param(init(rngs.params(), (d, e), pd))
        self.w_gate = nnx.Param(init(rngs.params(), (e, f, d), pd))
        self.w_up = nnx.Param(init(rngs.params(), (e, f, d), pd))
        self.w_down = nnx.Param(init(rngs.params(), (e, d, f), pd))
        has_shared = cfg.shared_expert_d_ff > 0
        self.shared = SwiGLU(d, cfg.shared_expert_d_ff, cfg, rngs=rngs) if has_shared else None
        gated = has_shared and cfg.shared_expert_gated
        self.shared_gate = nnx.Param(init(rngs.params(), (d,), pd)) if gated else None
        self.cfg = cfg

    def router_logits(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, E] float32 (matmul in the compute dtype, float32 accumulation)."""
        return router_logits(x, self.router[...], self.cfg.dtype)

    def __call__(
        self,
        x: jax.Array,
        *,
        layer: int,
        site: QuantSite = identity_site,
        expert_choices: jax.Array | None = None,
        valid: jax.Array | None = None,
        impl: MoEImpl | str = MoEImpl.GROUPED,
        per_device: bool = False,
    ) -> tuple[jax.Array, Routing, jax.Array]:
        """Mix `x [B, T, D]` through the experts.

        Returns (y [B, T, D] in the compute dtype, routing, unscaled Switch aux loss over `valid`).
        `expert_choices [B, T, K]` replays expert indices instead of the router's top-k.
        per_device: inference only (the cached forward, `ModelConfig.moe_routing_per_device`):
        on a data-parallel mesh each device routes its own rows, runs the grouped experts on them
        and combines them (`rows_per_device`), the same values bit for bit. The aux loss stays
        outside, over all rows (GSPMD's reductions; a rollout discards it and XLA drops them).
        """
        cfg = self.cfg
        dt = cfg.dtype
        x = x.astype(dt)
        packed_for = getattr(site, "packed_experts_for", None)
        packed = None if packed_for is None else packed_for(layer)
        if packed is not None:  # FP4 rollout on the Pallas kernels: weights packed once
            x_val, x_q = site.quantized(x, name=SiteName.EXPERT_IN, layer=layer)
            x_in = x_val if x_q is None else x_q
            experts = functools.partial(
                experts_packed_fp4, layer=layer, site=site, dtype=dt,
                predecode=cfg.predecode_experts,
            )  # fmt: skip
            weights = packed
        else:
            x_in = site(x, name=SiteName.EXPERT_IN, layer=layer)
            weights = tuple(
                site(w[...].astype(dt), name=name, layer=layer)
                for w, name in (
                    (self.w_gate, SiteName.W_GATE),
                    (self.w_up, SiteName.W_UP),
                    (self.w_down, SiteName.W_DOWN),
                )
            )
            if MoEImpl(impl) == MoEImpl.GROUPED:
                grouped = functools.partial(
                    experts_grouped, layer=layer, site=site, matmul=cfg.grouped_matmul
                )
            else:
                grouped = functools.partial(experts_dense, layer=layer, site=site)

            def experts(x_in, weights, routing):
                return grouped(x_in, *weights, routing)

        def route_and_mix(rows, shared):
            x, x_in, expert_choices = rows
            router, weights = shared
            routing = route(
                router_logits(x, router, dt),
                top_k=cfg.top_k,
                norm_topk_prob=cfg.norm_topk_prob,
                expert_choices=expert_choices,
            )
            return experts(x_in, weights, routing), routing

        rows, shared = (x, x_in, expert_choices), (self.router[...], weights)
        if per_device:
            y, routing = rows_per_device(route_and_mix, rows, shared, site=site)
        else:
            y, routing = route_and_mix(rows, shared)
        return self._add_shared(x, y), routing, switch_aux_loss(routing, valid)

    def _add_shared(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """y plus the (gated) shared expert of x, if the model has one."""
        dt = self.cfg.dtype
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                g = jnp.einsum(
                    "btd,d->bt",
                    x,
                    self.shared_gate[...].astype(dt),
                    preferred_element_type=jnp.float32,
                )
                shared = shared * jax.nn.sigmoid(g)[..., None].astype(dt)
            y = y + shared
        return y
