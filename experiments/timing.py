"""Benchmark timing: median seconds per call of a jitted function, after warm-up.

Each trial enqueues `inner` calls back to back (JAX dispatch is asynchronous, so the device runs
them without gaps whenever a call takes longer than its dispatch) and blocks on the last one;
the median over trials, divided by `inner`, is reported. Calls shorter than the dispatch cost
(tens of microseconds) are measured as the dispatch cost: report such numbers as upper bounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def time_fn(fn: Callable, *args, inner: int = 20, trials: int = 7, warmup: int = 3) -> float:
    """Median seconds per call of the jitted `fn(*args)`."""
    f = jax.jit(fn)
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def nbytes(*trees) -> int:
    """Total bytes of all array leaves."""
    return sum(int(x.size) * x.dtype.itemsize for t in trees for x in jax.tree.leaves(t))
