"""Data- and expert-parallel placement on a `jax.make_mesh` mesh (GSPMD propagates the rest).

Mesh axes: "data" splits the batch (rollout rows, advantages, log-probs), "expert" splits the
routed expert weights `[E, ...]` along E. Everything else is replicated. The jitted steps are
unchanged: they run on whatever placement their inputs carry (inside `jax.set_mesh(mesh)`).
"""

from __future__ import annotations

import contextlib

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
    name = path if isinstance(path, str) else jax.tree_util.keystr(path)
    is_expert = any(f"'{w}'" in name or f".{w}" in name for w in EXPERT_WEIGHTS)
    if is_expert and getattr(x, "ndim", 0) == 3 and x.shape[0] % mesh.shape["expert"] == 0:
        return NamedSharding(mesh, P("expert"))
    return NamedSharding(mesh, P())


def param_sharding_rule(mesh: jax.sharding.Mesh):
    """`shard_model`'s placement as a function of a parameter's dotted path
    ("layers.0.moe.w_gate") and shape (a `jax.ShapeDtypeStruct`): the form
    `load_hf_checkpoint(shardings=...)` takes, so a checkpoint loads straight into it."""
    return lambda path, x: _param_sharding(mesh, path, x)


def _shard_state(module: nnx.Module, mesh: jax.sharding.Mesh) -> None:
    state = nnx.state(module)
    shardings = jax.tree_util.tree_map_with_path(lambda p, x: _param_sharding(mesh, p, x), state)
    nnx.update(module, jax.device_put(state, shardings))


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> None:
    """Places `model`'s state on `mesh` in place: routed expert weights split along E."""
    _shard_state(model, mesh)


def shard_optimizer(optimizer: nnx.Optimizer, model: nnx.Module, mesh) -> None:
    """Places the optimizer state like the parameters it tracks (moments follow their params:
    they have the same paths below the optimizer's, so `model` is not consulted)."""
    del model
    _shard_state(optimizer, mesh)


def shard_batch(tree, mesh: jax.sharding.Mesh, batch_size: int):
    """Splits every array whose leading axis is `batch_size` along "data"; replicates the rest."""
    if batch_size % mesh.shape["data"]:
        raise ValueError(f"batch {batch_size} is not divisible by {mesh.shape['data']} data shards")

    def place(x):
        lead = getattr(x, "ndim", 0) >= 1 and x.shape[0] == batch_size
        return jax.device_put(x, NamedSharding(mesh, P("data") if lead else P()))

    return jax.tree.map(place, tree)


def experiment_mesh(data: int, expert: int) -> jax.sharding.Mesh | None:
    """The (data, expert) mesh of a run, or None for 1 x 1 (one device, no sharding)."""
    return None if data * expert == 1 else make_mesh(data, expert)


def place_state(module: nnx.Module, mesh: jax.sharding.Mesh | None) -> None:
    """Places a model's or optimizer's state in place: on `mesh` (routed expert weights and
    their moments split along E), or without a mesh committed to the first device, as a
    restored checkpoint is, so that every jitted step compiles once."""
    if mesh is not None:
        _shard_state(module, mesh)
    else:
        nnx.update(module, jax.device_put(nnx.state(module), jax.devices()[0]))


def place_batch(tree, mesh: jax.sharding.Mesh | None, batch_size: int):
    """`tree` on the device(s): arrays whose leading axis is `batch_size` split along "data",
    the rest replicated (no mesh: on the default device)."""
    return jax.device_put(tree) if mesh is None else shard_batch(tree, mesh, batch_size)


def mesh_context(mesh: jax.sharding.Mesh | None):
    """The context jitted steps run in: `jax.set_mesh(mesh)`, or nothing without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
