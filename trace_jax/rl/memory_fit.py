"""Whether the trainer's state fits on each device of a mesh: per-device bytes of the parameters,
the optimizer state and the gradients, from shapes alone.

`nnx.eval_shape` builds the model and its `nnx.Optimizer` (the trainer's AdamW after gradient
clipping, `make_optimizer`) as trees of `jax.ShapeDtypeStruct`, nothing allocated, and
`sharding.state_shardings` places them on an `AbstractMesh`, so the mesh may be larger than the
machine. Every shard of a leaf has the same shape (the rule shards only dimensions the mesh axis
divides), so every device holds the same bytes.

What a device holds, per kind:
  params     the master copy, in `ModelConfig.param_dtype` (float32 in every preset; the forward
             computes in `dtype`, bf16, casting each weight where it is used);
  optimizer  AdamW's mu and nu, in the parameters' dtype (optax's default), placed like their
             parameters, and its step counters (replicated);
  gradients  one per parameter, with its dtype and placement (`nnx.grad` returns them in the
             parameters' dtype; the sharded update consumes each where its parameter lives).
Left out, and what the headroom (capacity minus this state) has to hold: activations and what
the backward saves of them, a layer's weights while FSDP has them gathered, the rollout's KV
cache, XLA's temporaries and the runtime's own reserve.

Axis legend: data, fsdp, expert: the mesh axes (`sharding.MESH_AXES`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trace_jax.models import ModelConfig, Qwen3MoE
from trace_jax.rl.config import GRPOConfig, make_optimizer
from trace_jax.rl.sharding import AnyMesh, abstract_mesh, state_shardings

GB = 1e9  # bytes; GPU memory sizes are quoted in these units (80 GB, 141 GB)


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of the trainer's state on one device of a mesh (module docstring)."""

    params: int
    optimizer: int
    gradients: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.gradients


def abstract_train_state(
    cfg: ModelConfig, optimizer: optax.GradientTransformation | None = None
) -> tuple[nnx.State, nnx.State]:
    """(parameters, optimizer state) of `Qwen3MoE(cfg)` and `nnx.Optimizer(model, optimizer)` as
    `jax.ShapeDtypeStruct` leaves; `optimizer` None: the trainer's (`make_optimizer` of the
    default `GRPOConfig`: AdamW, which holds two moments per parameter)."""
    tx = make_optimizer(GRPOConfig()) if optimizer is None else optimizer

    def build():
        model = Qwen3MoE(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, opt = nnx.eval_shape(build)
    return nnx.state(model, nnx.Param), nnx.state(opt)


def device_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` (leaves with `.shape` and `.dtype`) placed by
    `shardings` (a matching tree of NamedSharding)."""
    leaves = jax.tree.leaves(tree)
    placed = jax.tree.leaves(shardings)
    return sum(
        math.prod(s.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize
        for x, s in zip(leaves, placed, strict=True)
    )


def train_state_bytes(params: nnx.State, opt_state: nnx.State, mesh: AnyMesh) -> StateBytes:
    """Per-device bytes of the state `abstract_train_state` returns, on `mesh` (a Mesh or an
    AbstractMesh with the (data, fsdp, expert) axes)."""
    param_bytes = device_bytes(params, state_shardings(params, mesh))
    opt_bytes = device_bytes(opt_state, state_shardings(opt_state, mesh, params))
    return StateBytes(params=param_bytes, optimizer=opt_bytes, gradients=param_bytes)


def memory_fit_rows(
    cfg: ModelConfig,
    meshes: Sequence[Sequence[int]],
    *,
    capacities_gb: Sequence[float] = (80.0, 141.0),
    param_dtypes: Sequence[str] | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> list[dict]:
    """One row per parameter dtype and mesh: the per-device state of `cfg`'s trainer and, per
    GPU memory size, whether it fits and what is left beside it.

    meshes: (data, fsdp, expert) sizes, `sharding.MESH_AXES` order. param_dtypes: the master
      copy's dtypes to try (`cfg.param_dtype` when None).
    Row: devices, data, fsdp, expert, param_dtype, params_GB, optimizer_GB, gradients_GB,
      state_GB, and per capacity C `fits_<C>GB` ("yes" / "no") and `left_<C>GB` (C - state_GB:
      the headroom for what the module docstring lists; negative when it does not fit).
    """
    dtypes = [jnp.dtype(d).name for d in (param_dtypes or [cfg.param_dtype])]
    for shape in meshes:
        if len(shape) != 3:
            raise ValueError(f"a mesh is (data, fsdp, expert) sizes, got {tuple(shape)}")
    rows = []
    for dtype in dtypes:
        params, opt_state = abstract_train_state(
            dataclasses.replace(cfg, param_dtype=dtype), optimizer
        )
        for data, fsdp, expert in meshes:
            state = train_state_bytes(params, opt_state, abstract_mesh(data, expert, fsdp=fsdp))
            row = {
                "devices": data * fsdp * expert,
                "data": data,
                "fsdp": fsdp,
                "expert": expert,
                "param_dtype": dtype,
                "params_GB": state.params / GB,
                "optimizer_GB": state.optimizer / GB,
                "gradients_GB": state.gradients / GB,
                "state_GB": state.total / GB,
            }
            for capacity in capacities_gb:
                left = capacity - state.total / GB
                row[f"fits_{capacity:g}GB"] = "yes" if left >= 0 else "no"
                row[f"left_{capacity:g}GB"] = left
            rows.append(row)
    return rows
