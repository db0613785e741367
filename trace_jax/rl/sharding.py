"""Data- and expert-parallel placement on a `jax.make_mesh` mesh (GSPMD propagates the rest).

Mesh axes: "data" splits the batch (rollout rows, advantages, log-probs), "expert" splits the
routed expert weights `[E, ...]` along E. Everything else is replicated. The jitted steps are
unchanged: they run on whatever placement their inputs carry (inside `jax.set_mesh(mesh)`).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def make_mesh(data: int, expert: int = 1) -> jax.sharding.Mesh:
    """A (data, expert) mesh of `data * expert` devices with automatic (GSPMD) axes."""
    if data * expert > jax.device_count():
        raise ValueError(
            f"a {data} x {expert} mesh needs {data * expert} devices, have {jax.device_count()}"
        )
    return jax.make_mesh((data, expert), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)


def _param_sharding(mesh, path, x) -> NamedSharding:
    name = jax.tree_util.keystr(path)
    is_expert = any(f"'{w}'" in name or f".{w}" in name for w in EXPERT_WEIGHTS)
    if is_expert and getattr(x, "ndim", 0) == 3 and x.shape[0] % mesh.shape["expert"] == 0:
        return NamedSharding(mesh, P("expert"))
    return NamedSharding(mesh, P())


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> None:
    """Places `model`'s state on `mesh` in place: routed expert weights split along E."""
    state = nnx.state(model)
    shardings = jax.tree_util.tree_map_with_path(lambda p, x: _param_sharding(mesh, p, x), state)
    nnx.update(model, jax.device_put(state, shardings))


def shard_optimizer(optimizer: nnx.Optimizer, model: nnx.Module, mesh) -> None:
    """Places the optimizer state like the parameters it tracks (moments follow their params)."""
    state = nnx.state(optimizer)
    shardings = jax.tree_util.tree_map_with_path(lambda p, x: _param_sharding(mesh, p, x), state)
    nnx.update(optimizer, jax.device_put(state, shardings))


def shard_batch(tree, mesh: jax.sharding.Mesh, batch_size: int):
    """Splits every array whose leading axis is `batch_size` along "data"; replicates the rest."""
    if batch_size % mesh.shape["data"]:
        raise ValueError(f"batch {batch_size} is not divisible by {mesh.shape['data']} data shards")

    def place(x):
        lead = getattr(x, "ndim", 0) >= 1 and x.shape[0] == batch_size
        return jax.device_put(x, NamedSharding(mesh, P("data") if lead else P()))

    return jax.tree.map(place, tree)
