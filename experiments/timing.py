"""Benchmark timing: median seconds per call of a jitted function, after warm-up.

Each trial enqueues `inner` calls back to back (JAX dispatch is asynchronous, so the device runs
them without gaps whenever a call takes longer than its dispatch) and blocks on the last one; the
median over trials, divided by `inner`, is reported. Calls shorter than the dispatch cost (tens of
microseconds) are measured as the dispatch cost: report such numbers as upper bounds.
`time_interleaved` times several functions in alternating rounds, so that a drift of the device
(clocks, temperature, a neighbour's load) falls on all of them alike and ratios can be taken round
by round. `time_in_device_loop` times a short call inside one jitted loop instead, below the host's
dispatch floor (`loop_floor_fn` gives the loop's own cost per call).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

# `device_loop_times`' key of the loop's own cost per call.
LOOP_FLOOR = "loop_floor"


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


def time_fn(
    fn: Callable, *args, inner: int = 20, trials: int = 7, warmup: int = 3, smoke: bool = False
) -> float:
    """Median seconds per call of the jitted `fn(*args)`. `smoke`: one warm-up and one timed
    call (a CPU smoke run of a benchmark, whose numbers mean nothing)."""
    if smoke:
        inner, trials, warmup = 1, 1, 1
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
    after each, e.g. to log or time the compilation; a `jax.stages.Compiled` fn runs as it is,
    compiled by the caller); then each of `rounds` rounds times every
    function once (the median of `trials` trials of `inner` calls), in an order rotated by one
    per round so that no function always runs first. Returns name -> its `rounds` per-round
    seconds per call.
    """
    if rounds < 1 or not calls:
        raise ValueError(f"need at least one round and one call, got {rounds} and {len(calls)}")
    ready = {}
    for name, (fn, args) in calls.items():
        f = fn if isinstance(fn, jax.stages.Compiled) else jax.jit(fn)
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


def chained_loop(
    fn: Callable, args: tuple, reps: int, *, unroll: int = 1, carry_arg: int = 0
) -> Callable:
    """`loop(*leaves)`: `reps` calls of `fn(*args)` inside one device loop (`leaves`: the flat
    leaves of `args`, the loop's jit arguments), argument `carry_arg` made to depend on the
    previous call's output: each of its leaves gets the output's first element times 0.0 added
    at index 0 (a float product with 0.0 is not folded away: it is NaN for an inf or NaN input).
    So no call is hoisted out of the loop as invariant or dropped as dead, and the calls run one
    after another, as decode steps do. `unroll` calls per loop iteration (`fori_loop`) spread
    the loop's per-iteration control cost. Returns the final `args[carry_arg]`'s leaves."""
    if reps < 1 or unroll < 1 or reps % unroll:
        raise ValueError(f"reps must be a positive multiple of unroll, got {reps} and {unroll}")
    if not 0 <= carry_arg < len(args):
        raise ValueError(f"carry_arg {carry_arg} is not one of the {len(args)} arguments")
    treedef = jax.tree.structure(tuple(args))
    lo = len(jax.tree.leaves(tuple(args[:carry_arg])))
    hi = lo + len(jax.tree.leaves(args[carry_arg]))

    def loop(*leaves):
        def body(_, carried):
            call_args = jax.tree.unflatten(treedef, [*leaves[:lo], *carried, *leaves[hi:]])
            out = fn(*call_args)
            zero = jax.tree.leaves(out)[0].reshape(-1)[0].astype(jnp.float32) * 0.0
            return [x.at[(0,) * x.ndim].add(zero.astype(x.dtype)) for x in carried]

        return jax.lax.fori_loop(0, reps, body, list(leaves[lo:hi]), unroll=unroll)

    return loop


def time_in_device_loop(
    fn: Callable,
    args: tuple,
    reps: int,
    *,
    unroll: int = 1,
    carry_arg: int = 0,
    trials: int = 5,
    smoke: bool = False,
) -> float:
    """Seconds per call of `fn(*args)` run `reps` times in one jitted device loop
    (`chained_loop`): the host dispatches once per loop, so a call shorter than the host's
    per-call dispatch (tens of microseconds, where `time_fn` measures the dispatch) is timed at
    the device's pace. Includes the loop's own cost per call (its control and the one-element
    dependency update on argument `carry_arg`, best a small one such as the activations): time
    `loop_floor_fn` on that argument alone to see it."""
    loop = chained_loop(fn, args, reps, unroll=unroll, carry_arg=carry_arg)
    leaves = jax.tree.leaves(args)
    return time_fn(loop, *leaves, inner=1, trials=trials, warmup=1, smoke=smoke) / reps


def loop_floor_fn(first) -> jax.Array:
    """A call that does (almost) nothing: `first`'s first leaf's first element, float32 [1].
    `time_in_device_loop(loop_floor_fn, (a,), ...)` is the loop's own cost per call with `a` as
    its carried argument, to set beside a kernel's."""
    return jax.tree.leaves(first)[0].reshape(-1)[:1].astype(jnp.float32)


def paired_ratio(by_round: dict[str, list[float]], num: str, den: str) -> float:
    """The median over rounds of `num`'s time over `den`'s in the same round
    (`time_interleaved`'s output)."""
    pairs = zip(by_round[num], by_round[den], strict=True)
    return statistics.median(x / y for x, y in pairs)


def device_loop_times(
    calls: Mapping,
    floor_arg,
    *,
    loop_seconds: float,
    unroll: int,
    per_call_s: Mapping | float,
    carry_arg: Mapping | int = 0,
    smoke: bool = False,
) -> dict:
    """key -> seconds per call of each `calls[key] = (fn, args)` inside one device loop
    (`time_in_device_loop`, `unroll` calls an iteration), each loop about `loop_seconds` of
    calls as sized by `per_call_s` (key -> an estimate of its per-call seconds, the smallest for
    a key it lacks; or one estimate for all); and `LOOP_FLOOR` -> the loop's own cost per call,
    with `floor_arg` carried. `carry_arg`: the argument each loop carries (key -> its index, 0
    for a key it lacks; or one index for all). A call's work on arguments the loop does not carry
    is loop-invariant, and XLA hoists it out of the loop: carry the argument such work reads."""
    estimates = per_call_s if isinstance(per_call_s, Mapping) else {}
    out = {}
    for key, (fn, args) in [*calls.items(), (LOOP_FLOOR, (loop_floor_fn, (floor_arg,)))]:
        est = estimates.get(key, min(estimates.values())) if estimates else per_call_s
        reps = unroll * max(1, math.ceil(loop_seconds / est / unroll))
        if key == LOOP_FLOOR:
            carry = 0
        else:
            carry = carry_arg.get(key, 0) if isinstance(carry_arg, Mapping) else carry_arg
        out[key] = time_in_device_loop(fn, args, reps, unroll=unroll, carry_arg=carry, smoke=smoke)
    return out
