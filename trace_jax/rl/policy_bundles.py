"""Policy versions through the exchange: the trainer publishes each version as a bundle
`policy/<v>/` (one array per parameter, crc32 each; `publish_policy`, in the background behind
its next step with `PolicyPublisher`), the rollout process reads it verified and places it like
its model's parameters (`load_policy`, ahead of its steps with `PolicyPrefetcher`). The
handshake around them (which version a step waits for, how many are kept) is
`trace_jax.rl.disaggregated`'s."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.rl.exchange import Exchange, manifest_key

log = logging.getLogger(__name__)


def policy_prefix(version: int) -> str:
    return f"policy/{version}/"


def publish_policy(exchange: Exchange, model: nnx.Module, version: int) -> None:
    """Commits `model`'s parameters as the bundle `policy_prefix(version)` (one array per
    parameter, named by its key path; this process must hold every shard of each)."""
    publish_params(exchange, nnx.state(model, nnx.Param), version)


def publish_params(exchange: Exchange, params: nnx.State, version: int) -> None:
    """`publish_policy` of the parameter state `params` (device or host arrays)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    arrays = {jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in leaves}
    exchange.write_arrays(policy_prefix(version), arrays, {"version": version})


class PolicyPublisher:
    """The trainer's side of the policy handshake, behind its steps: `submit` takes a device
    copy of the model's parameters at once (the next update donates them) and writes that
    version's bundle, then deletes the bundles the step consumed, on one background thread,
    while the trainer goes on to its next batch. Versions commit in order: a `submit` first
    waits for the previous one and raises its failure, so at most one bundle is in flight and
    the trainer learns of a failed write one step later at most. `close` waits for the last.
    """

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._pending: concurrent.futures.Future | None = None

    def submit(self, model: nnx.Module, version: int, delete: tuple[str, ...] = ()) -> float:
        """Starts publishing `model`'s parameters as `version`, then deleting the bundles at
        the prefixes `delete`. Returns the seconds spent waiting for the previous version."""
        params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
        waited = self.wait()
        self._pending = self._pool.submit(self._publish, params, version, delete)
        return waited

    def wait(self) -> float:
        """Waits for the version in flight (raising its failure); returns the seconds waited."""
        pending, self._pending = self._pending, None
        t0 = time.perf_counter()
        if pending is not None:
            pending.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Waits for the version in flight (raising its failure) and stops the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> PolicyPublisher:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
            return
        try:  # another failure is propagating: the write in flight ends first, quietly
            self.close()
        except Exception as e:
            log.error("publishing the last policy version failed too: %s", e)

    def _publish(self, params: nnx.State, version: int, delete: tuple[str, ...]) -> None:
        publish_params(self.exchange, params, version)
        for prefix in delete:
            self.exchange.delete(prefix)


def load_policy(exchange: Exchange, version: int, target: nnx.State) -> nnx.State:
    """Policy `version`, verified, as `target` (the model's `nnx.Param` state) is laid out:
    each array placed with the sharding of `target`'s. ValueError when the policy holds other
    parameters (names, shapes or dtypes) than `target`."""
    return place_policy(read_policy(exchange, version, target), target)


def read_policy(exchange: Exchange, version: int, target: nnx.State) -> list[np.ndarray]:
    """`load_policy`'s host arrays, verified, one per leaf of `target` in its leaf order."""
    where = exchange.where(policy_prefix(version))
    _, arrays = exchange.read_arrays(policy_prefix(version))
    leaves = jax.tree_util.tree_flatten_with_path(target)[0]
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    if set(names) != set(arrays):
        raise ValueError(
            f"{where} holds other parameters than this model: it lacks "
            f"{sorted(set(names) - set(arrays))[:3]}, the model lacks "
            f"{sorted(set(arrays) - set(names))[:3]}"
        )
    for name, (_, x) in zip(names, leaves, strict=True):
        got = arrays[name]
        if got.shape != x.shape or got.dtype != x.dtype:
            raise ValueError(
                f"{where}: {name} is {got.dtype}{list(got.shape)}, the model's "
                f"{x.dtype}{list(x.shape)}"
            )
    return [arrays[name] for name in names]


def place_policy(host: list[np.ndarray], target: nnx.State) -> nnx.State:
    """`read_policy`'s arrays as `target` is laid out (each with its leaf's sharding)."""
    leaves, treedef = jax.tree_util.tree_flatten(target)
    placed = [jax.device_put(h, x.sharding) for h, x in zip(host, leaves, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, placed)


class PolicyPrefetcher:
    """The rollout's side of the handshake, ahead of its steps: `prefetch(version)` waits for
    that version on a background thread and reads and verifies it into host memory while the
    rollout samples; `take(version)` returns it placed like the model's parameters (the
    prefetched one, else read now), raising the prefetch's failure. `close` stops a prefetch
    still waiting (`wait(key, what, stop)` returns or raises once `stop` is set)."""

    def __init__(self, exchange: Exchange, target: nnx.State, wait: Callable[..., None]):
        self.exchange, self.target, self._wait = exchange, target, wait
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self._stop = threading.Event()
        self._pending: tuple[int, concurrent.futures.Future] | None = None

    def prefetch(self, version: int) -> None:
        self._pending = (version, self._pool.submit(self._read, version))

    def take(self, version: int) -> nnx.State:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != version:
            host = self._read(version)
        else:
            host = pending[1].result()
        return place_policy(host, self.target)

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PolicyPrefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, version: int) -> list[np.ndarray]:
        key = manifest_key(policy_prefix(version))
        self._wait(key, f"policy version {version}", self._stop)
        return read_policy(self.exchange, version, self.target)
