"""Data-, FSDP- and expert-parallel placement on a (data, fsdp, expert) mesh; GSPMD propagates
the rest.

Mesh axes, outermost first:
  data    splits the batch (rollout rows, advantages, log-probs); parameters are replicated
          along it, so its only traffic is the gradient all-reduce.
  fsdp    splits the batch too, and every parameter matrix with its optimizer state (FSDP,
          ZeRO-3): a device holds 1/fsdp of each and the step all-gathers a matrix where it is
          used.
  expert  splits the routed expert weights `[E, ...]` along E.

Why an `fsdp` axis of its own rather than FSDP over "data" (big_vision's `fsdp(axis="data")`):
it is MaxText's layout (`ici_fsdp_parallelism` beside `dcn_data_parallelism`), hybrid sharding,
where the FSDP all-gathers stay inside a node's NVLink domain and only gradients cross the
slower links between nodes along "data"; and fsdp = 1 is exactly the (data, expert) placement,
so runs and checkpoint loads that do not ask for FSDP keep their layout.

The parameter rule (`param_spec`) is big_vision's `fsdp` rule after the expert split: a routed
expert weight `[E, ...]` has E over "expert" where it divides; then a parameter of two or more
dimensions has its largest dimension that fsdp divides and no axis takes yet over "fsdp" (the
first on a tie). Vectors (norm scales) stay replicated: their bytes are negligible and each
would cost a gather. Mesh axes of size 1 are left out of specs (and trailing None), so
`P("expert")` is the spec of an expert weight without FSDP.

Optimizer state follows its parameter (`state_shardings`): a leaf whose path ends with a
parameter's path and has its shape (AdamW's mu and nu) takes the parameter's sharding; the
rest (step counts) is replicated. The jitted steps are unchanged: they run on whatever
placement their inputs carry, inside `jax.set_mesh(mesh)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax.models.moe import DATA_AXIS

MESH_AXES = (DATA_AXIS, "fsdp", "expert")
BATCH_AXES = ("data", "fsdp")  # the batch's leading axis splits over both
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")

AnyMesh = jax.sharding.Mesh | AbstractMesh


def _mesh_sizes(data: int, expert: int, fsdp: int) -> tuple[int, int, int]:
    """(data, fsdp, expert) in `MESH_AXES` order, each checked to be an int >= 1."""
    sizes = {"data": data, "fsdp": fsdp, "expert": expert}
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"mesh axis sizes must be ints >= 1, got {bad}")
    return data, fsdp, expert


def make_mesh(data: int, expert: int = 1, *, fsdp: int = 1) -> jax.sharding.Mesh:
    """A (data, fsdp, expert) mesh of `data * fsdp * expert` devices with automatic (GSPMD)
    axes."""
    shape = _mesh_sizes(data, expert, fsdp)
    n = data * fsdp * expert
    if n > jax.device_count():
        raise ValueError(
            f"a {data} x {fsdp} x {expert} (data, fsdp, expert) mesh needs {n} devices, "
            f"have {jax.device_count()}"
        )
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def abstract_mesh(data: int, expert: int = 1, *, fsdp: int = 1) -> AbstractMesh:
    """The (data, fsdp, expert) mesh's shape without devices: shardings on it give shard shapes
    of a mesh larger than this machine (`trace_jax.rl.memory_fit`)."""
    shape = _mesh_sizes(data, expert, fsdp)
    return AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _path_names(path) -> tuple[str, ...]:
    """("layers", "0", "moe", "w_gate") of a dotted path "layers.0.moe.w_gate" or of a pytree
    key path (nnx's trailing `.value` dropped)."""
    if isinstance(path, str):
        names = tuple(path.split("."))
    else:
        names = tuple(
            str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path
        )
    return names[:-1] if names and names[-1] == "value" else names


def _spec(axes: list[str | None], mesh_shape: Mapping[str, int]) -> P:
    """`P(*axes)` without axes of size 1 and without trailing None."""
    kept = [a if a is not None and mesh_shape[a] > 1 else None for a in axes]
    while kept and kept[-1] is None:
        kept.pop()
    return P(*kept)


def param_spec(path, shape: tuple[int, ...], mesh_shape: Mapping[str, int]) -> P:
    """The PartitionSpec of the parameter at `path` (dotted or a key path) of `shape` on a mesh
    of `mesh_shape` (axis name -> size; the module docstring states the rule)."""
    axes: list[str | None] = [None] * len(shape)
    names = _path_names(path)
    is_expert = bool(names) and names[-1] in EXPERT_WEIGHTS and len(shape) == 3
    if is_expert and shape[0] % mesh_shape["expert"] == 0:
        axes[0] = "expert"
    fsdp = mesh_shape["fsdp"]
    if len(shape) >= 2 and fsdp > 1:
        free = [i for i, n in enumerate(shape) if axes[i] is None and n % fsdp == 0]
        if free:
            axes[max(free, key=lambda i: shape[i])] = "fsdp"  # max keeps the first on a tie
    return _spec(axes, mesh_shape)


def param_sharding_rule(mesh: AnyMesh) -> Callable[[str, Any], NamedSharding]:
    """`shard_model`'s placement as a function of a parameter's dotted path
    ("layers.0.moe.w_gate") and shape (a `jax.ShapeDtypeStruct`): the form
    `load_hf_checkpoint(shardings=...)` takes, so a checkpoint loads straight into it."""
    return lambda path, x: NamedSharding(mesh, param_spec(path, tuple(x.shape), mesh.shape))


def state_shardings(state, mesh: AnyMesh, params=None):
    """A NamedSharding per array leaf of `state` (an nnx State or any pytree of arrays or
    `jax.ShapeDtypeStruct`s).

    params: the parameters (a pytree, e.g. `nnx.state(model, nnx.Param)`) whose placement the
      leaves follow: a leaf whose key path ends with a parameter's path and that has its shape
      gets the parameter's sharding, any other leaf is replicated. None: `state` holds the
      parameters themselves.
    """
    by_path: dict[tuple[str, ...], tuple[tuple[int, ...], P]] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(state if params is None else params):
        shape = tuple(x.shape)
        by_path[_path_names(path)] = (shape, param_spec(path, shape, mesh.shape))

    def sharding(path, x) -> NamedSharding:
        names, shape = _path_names(path), tuple(getattr(x, "shape", ()))
        for start in range(len(names)):  # longest suffix first
            hit = by_path.get(names[start:])
            if hit is not None and hit[0] == shape:
                return NamedSharding(mesh, hit[1])
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(sharding, state)


def _shard_state(module: nnx.Module, mesh: jax.sharding.Mesh, params=None) -> None:
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, state_shardings(state, mesh, params)))


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> None:
    """Places `model`'s state on `mesh` in place (`param_spec`)."""
    _shard_state(model, mesh)


def shard_optimizer(optimizer: nnx.Optimizer, model: nnx.Module, mesh) -> None:
    """Places the optimizer state in place like the parameters of `model` it tracks."""
    _shard_state(optimizer, mesh, nnx.state(model, nnx.Param))


def batch_spec(mesh: AnyMesh) -> P:
    """The spec of a batch-leading array: the leading axis over data x fsdp."""
    axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    if not axes:
        return P()
    return P(axes[0] if len(axes) == 1 else axes)


def shard_batch(tree, mesh: jax.sharding.Mesh, batch_size: int):
    """Splits every array whose leading axis is `batch_size` over data x fsdp; replicates the
    rest."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % shards:
        raise ValueError(
            f"batch {batch_size} is not divisible by {shards} batch shards "
            f"(data {mesh.shape['data']} x fsdp {mesh.shape['fsdp']})"
        )
    split = NamedSharding(mesh, batch_spec(mesh))

    def place(x):
        lead = getattr(x, "ndim", 0) >= 1 and x.shape[0] == batch_size
        return jax.device_put(x, split if lead else NamedSharding(mesh, P()))

    return jax.tree.map(place, tree)


def experiment_mesh(data: int, expert: int, fsdp: int = 1) -> jax.sharding.Mesh | None:
    """The (data, fsdp, expert) mesh of a run, or None for 1 x 1 x 1 (one device, no
    sharding)."""
    return None if data * expert * fsdp == 1 else make_mesh(data, expert, fsdp=fsdp)


def place_state(
    module: nnx.Module, mesh: jax.sharding.Mesh | None, model: nnx.Module | None = None
) -> None:
    """Places a model's or optimizer's state in place: on `mesh` (`state_shardings`: an
    optimizer's moments follow the parameters of `model`; without it each leaf is placed by the
    parameter rule on its own path and shape), or without a mesh committed to the first device,
    as a restored checkpoint is, so that every jitted step compiles once."""
    if mesh is not None:
        _shard_state(module, mesh, None if model is None else nnx.state(model, nnx.Param))
    else:
        nnx.update(module, jax.device_put(nnx.state(module), jax.devices()[0]))


def place_batch(tree, mesh: jax.sharding.Mesh | None, batch_size: int):
    """`tree` on the device(s): arrays whose leading axis is `batch_size` split over data x
    fsdp, the rest replicated (no mesh: on the default device)."""
    return jax.device_put(tree) if mesh is None else shard_batch(tree, mesh, batch_size)


def mesh_context(mesh: jax.sharding.Mesh | None):
    """The context jitted steps run in: `jax.set_mesh(mesh)`, or nothing without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
