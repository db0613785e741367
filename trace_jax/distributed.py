"""Multi-process runs in JAX's multi-controller model: joining the run (`DistributedConfig`,
`initialize`), and the host-side work every process of it does.

  initialize(DistributedConfig(coordinator="10.0.0.1:1234", num_processes=2, process_id=0))
  rows = process_rows(sharding, n)                # this process's rows of an n-row batch
  batch = rows_from_local(local, sharding, n)     # its rows -> one global array
  tokens = read_rows(roll.tokens, rows)           # its rows of a global array, as numpy
  whole = host_value(metrics)                     # a global array's value, on every process
  on_primary(lambda: write_log(row), "the log")   # files once, by process 0

Every process runs the same program. Jitted steps run on one mesh over every process's devices;
a global array's shards on other processes' devices are not readable here. Host work is either
each process's own share of a batch split along rows (`process_rows`, `rows_from_local`,
`read_rows`) or the same on every process (`host_value`). Files are written by process 0
alone (`on_primary`); every collective (a jitted step, `host_value`, `barrier`, `on_primary`) is
reached by every process in the same order, from its main thread.

With one process (no coordinator), every array is addressable and the helpers reduce to numpy
conversions: the same program runs either way.

Axis legend: B rows of a batch (its leading axis).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

AUTO = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How this process joins a run of several processes.

    coordinator: "" (one process: nothing to join); "auto" (JAX's own detection of the cluster:
      Cloud TPU pods, SLURM, Open MPI; `num_processes` and `process_id` override what it
      detects when set); or "host:port", where process 0 serves the coordination service (every
      process names the same address; `num_processes` and `process_id` are then required).
    num_processes: the run's process count (>= 1). process_id: this process's rank, in
      [0, num_processes).
    """

    coordinator: str = ""
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "coordinator", (self.coordinator or "").strip())
        problems = []
        n, rank, where = self.num_processes, self.process_id, self.coordinator
        for name, value in (("num_processes", n), ("process_id", rank)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                problems.append(f"{name} must be an int or None, got {value!r}")
        if not problems:
            if n is not None and n < 1:
                problems.append(f"num_processes must be >= 1, got {n}")
            if rank is not None and (rank < 0 or (n is not None and rank >= n)):
                problems.append(f"process_id must be in [0, num_processes={n}), got {rank}")
        if not where and (n, rank) != (None, None):
            problems.append(
                f"num_processes={n} and process_id={rank} need a coordinator: set it to "
                "'host:port' (process 0's address) or 'auto'"
            )
        if where and where != AUTO:
            host, _, port = where.rpartition(":")
            if not host or not port.isdigit():
                problems.append(f"coordinator must be 'host:port' or {AUTO!r}, got {where!r}")
            if None in (n, rank):
                problems.append(
                    f"coordinator {where!r} needs num_processes and process_id, got {n} and "
                    f"{rank} (or use coordinator={AUTO!r} on a cluster JAX detects)"
                )
        if problems:
            raise ValueError("DistributedConfig: " + "; ".join(problems))

    @property
    def joins(self) -> bool:
        """Whether this process joins a multi-process run (a coordinator is set)."""
        return bool(self.coordinator)


def initialize(config: DistributedConfig) -> None:
    """Joins the run `config` describes (`jax.distributed.initialize`); nothing without a
    coordinator. Must precede any use of a JAX backend (`jax.devices()`, a computation): JAX
    raises RuntimeError otherwise. Blocks until every process has joined."""
    if not config.joins:
        return
    # Collectives between processes on the CPU go through gloo (TCP); the option only concerns
    # the CPU client, so GPU and TPU runs are unaffected.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.coordinator == AUTO:
        jax.distributed.initialize(num_processes=config.num_processes, process_id=config.process_id)
    else:
        jax.distributed.initialize(
            config.coordinator, num_processes=config.num_processes, process_id=config.process_id
        )
    log.info(
        "process %d of %d: %d of %d devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def is_primary() -> bool:
    """Whether this is process 0, the one that writes the run's files."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (one process: returns at once)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def on_primary[T](fn: Callable[[], T], what: str) -> T | None:
    """`fn()` on process 0 alone; every process returns once it finished (with its result on
    process 0, None elsewhere). A failure raises on every process (the exception itself on
    process 0, a RuntimeError naming `what` elsewhere), so that none waits forever at the next
    collective."""
    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    if is_primary():
        try:
            result = fn()
        except Exception as e:
            error = e
    failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
    if error is not None:
        raise error
    if int(failed):
        raise RuntimeError(f"{what} failed on process 0 (its log says why)")
    return result


def host_value(tree: Any) -> Any:
    """Every array leaf's whole value as numpy, on every process: an array whose shards all
    lie here (one process, or replicated) is read locally, any other is gathered from every
    process (`process_allgather`, a collective). Meant for small arrays: metrics, rewards."""

    def whole(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x)

    return jax.tree.map(whole, tree)


def process_rows(sharding: jax.sharding.Sharding | None, n: int) -> slice:
    """The rows of an n-row batch (`[B, ...]`, placed by `sharding`) that this process's devices
    hold, as one slice (all of them with one process or without a sharding). Raises ValueError
    when they are not contiguous (a mesh whose devices interleave processes along rows)."""
    if sharding is None or sharding.is_fully_addressable:
        return slice(0, n)
    held = sharding.addressable_devices_indices_map((n,)).values()
    spans = sorted({index[0].indices(n)[:2] for index in held})
    for (_, stop), (start, _) in itertools.pairwise(spans):
        if start != stop:
            raise ValueError(
                f"process {jax.process_index()} holds rows {spans} of a {n}-row batch under "
                f"{sharding}; expected one contiguous range (order the mesh's devices by process)"
            )
    return slice(spans[0][0], spans[-1][1])


def rows_from_local(tree: Any, sharding: jax.sharding.Sharding | None, n: int) -> Any:
    """One global array per leaf of `tree` (host arrays `[b, ...]`: this process's rows
    `process_rows(sharding, n)` of an n-row batch), placed by `sharding` (without one, on the
    default device)."""
    if sharding is None:
        return jax.device_put(tree)

    def place(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (n, *x.shape[1:]))

    return jax.tree.map(place, tree)


def read_rows(x: jax.Array | np.ndarray, rows: slice) -> np.ndarray:
    """`x[rows]` of `x [B, ...]`, read from this process's shards of it (rows of a batch this
    process holds: `process_rows`). Raises ValueError when its devices do not hold them all."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)[rows]
    start, stop, _ = rows.indices(x.shape[0])
    out = np.empty((stop - start, *x.shape[1:]), x.dtype)
    filled = np.zeros(stop - start, bool)
    for shard in x.addressable_shards:
        lead, *rest = shard.index
        if any(r.indices(d)[:2] != (0, d) for r, d in zip(rest, x.shape[1:], strict=True)):
            continue  # a shard of part of each row; another local shard may hold whole rows
        a, b, _ = lead.indices(x.shape[0])
        lo, hi = max(a, start), min(b, stop)
        if lo < hi and not filled[lo - start : hi - start].all():
            out[lo - start : hi - start] = np.asarray(shard.data)[lo - a : hi - a]
            filled[lo - start : hi - start] = True
    if not filled.all():
        raise ValueError(
            f"process {jax.process_index()} does not hold whole rows {start}:{stop} of an array "
            f"{x.shape} placed by {x.sharding}"
        )
    return out


def check_mesh_spans_processes(mesh: jax.sharding.Mesh | None) -> None:
    """Raises ValueError unless `mesh` spans every device of the run when there are several
    processes (each process must take part in every jitted step)."""
    if jax.process_count() == 1:
        return
    size = 0 if mesh is None else mesh.devices.size
    if size != jax.device_count():
        raise ValueError(
            f"a run of {jax.process_count()} processes needs a mesh over all "
            f"{jax.device_count()} devices (the product of the mesh's axes), got "
            f"{size or 'no mesh'}"
        )
