"""Benchmark timing helpers: what they call, in which order, and what they return."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from experiments import harness


def _recording(name: str, log: list[str]):
    """A function that appends `name` to `log` each time the device runs it."""

    def fn(x):
        jax.debug.callback(lambda: log.append(name), ordered=True)
        return x + 1.0

    return fn


def test_time_interleaved_warms_up_then_rotates_the_order_each_round():
    log: list[str] = []
    ready: list[str] = []
    x = jnp.ones((4,))
    calls = {n: (_recording(n, log), (x,)) for n in "abc"}
    out = harness.time_interleaved(
        calls, rounds=4, inner=2, trials=1, warmup=1, on_ready=ready.append
    )
    assert ready == ["a", "b", "c"]
    assert {k: len(v) for k, v in out.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t > 0 for v in out.values() for t in v)
    timed = "".join(log[3:])  # after one warm-up call each
    assert timed == "aabbcc" + "bbccaa" + "ccaabb" + "aabbcc"
    with pytest.raises(ValueError, match="at least one round"):
        harness.time_interleaved(calls, rounds=0)


def test_paired_ratio_is_the_median_of_same_round_ratios():
    by_round = {"a": [2.0, 4.0, 9.0], "b": [1.0, 1.0, 3.0]}
    # same-round ratios 2, 4, 3 -> 3; the ratio of medians would be 4 / 1 = 4
    assert harness.paired_ratio(by_round, "a", "b") == 3.0


def test_time_fn_smoke_runs_one_warm_up_and_one_timed_call():
    log: list[str] = []
    t = harness.time_fn(_recording("a", log), jnp.ones((4,)), smoke=True)
    jax.effects_barrier()
    assert t > 0 and log == ["a", "a"]
    log.clear()
    harness.time_fn(_recording("a", log), jnp.ones((4,)), inner=2, trials=3, warmup=1)
    jax.effects_barrier()
    assert len(log) == 1 + 2 * 3
