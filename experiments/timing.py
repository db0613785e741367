"""Benchmark timing: median seconds per call of a jitted function, after warm-up.

Each trial enqueues `inner` calls back to back (JAX dispatch is asynchronous, so the device runs
them without gaps whenever a call takes longer than its dispatch) and blocks on the last one;
the median over trials, divided by `inner`, is reported. Calls shorter than the dispatch cost
(tens of microseconds) are measured as the dispatch cost: report such numbers as upper bounds.
`time_interleaved` times several functions in alternating rounds, so that a drift of the device
(clocks, temperature, a neighbour's load) falls on all of them alike and ratios can be taken
round by round.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import jax


def _median_trial(f: Callable, args: tuple, inner: int, trials: int) -> float:
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def time_fn(fn: Callable, *args, inner: int = 20, trials: int = 7, warmup: int = 3) -> float:
    """Median seconds per call of the jitted `fn(*args)`."""
    f = jax.jit(fn)
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    return _median_trial(f, args, inner, trials)


def time_interleaved(
    calls: Mapping[str, tuple[Callable, tuple]],
    *,
    rounds: int = 5,
    inner: int = 20,
    trials: int = 3,
    warmup: int = 3,
    on_ready: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of several jitted functions, timed in alternation.

    calls: name -> (fn, args). Every function is compiled and warmed up first (`on_ready(name)`
    after each, e.g. to log or time the compilation); then each of `rounds` rounds times every
    function once (the median of `trials` trials of `inner` calls), in an order rotated by one
    per round so that no function always runs first. Returns name -> its `rounds` per-round
    seconds per call.
    """
    if rounds < 1 or not calls:
        raise ValueError(f"need at least one round and one call, got {rounds} and {len(calls)}")
    ready = {}
    for name, (fn, args) in calls.items():
        f = jax.jit(fn)
        for _ in range(warmup):
            jax.block_until_ready(f(*args))
        ready[name] = (f, args)
        if on_ready is not None:
            on_ready(name)
    names = list(ready)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            per_round[name].append(_median_trial(*ready[name], inner, trials))
    return per_round


def nbytes(*trees) -> int:
    """Total bytes of all array leaves."""
    return sum(int(x.size) * x.dtype.itemsize for t in trees for x in jax.tree.leaves(t))
