"""Benchmark timing helpers: what they call, in which order, and what they return."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import timing


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
    out = timing.time_interleaved(
        calls, rounds=4, inner=2, trials=1, warmup=1, on_ready=ready.append
    )
    assert ready == ["a", "b", "c"]
    assert {k: len(v) for k, v in out.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t > 0 for v in out.values() for t in v)
    timed = "".join(log[3:])  # after one warm-up call each
    assert timed == "aabbcc" + "bbccaa" + "ccaabb" + "aabbcc"
    with pytest.raises(ValueError, match="at least one round"):
        timing.time_interleaved(calls, rounds=0)


def test_paired_ratio_is_the_median_of_same_round_ratios():
    by_round = {"a": [2.0, 4.0, 9.0], "b": [1.0, 1.0, 3.0]}
    # same-round ratios 2, 4, 3 -> 3; the ratio of medians would be 4 / 1 = 4
    assert timing.paired_ratio(by_round, "a", "b") == 3.0


def test_time_fn_smoke_runs_one_warm_up_and_one_timed_call():
    log: list[str] = []
    t = timing.time_fn(_recording("a", log), jnp.ones((4,)), smoke=True)
    jax.effects_barrier()
    assert t > 0 and log == ["a", "a"]
    log.clear()
    timing.time_fn(_recording("a", log), jnp.ones((4,)), inner=2, trials=3, warmup=1)
    jax.effects_barrier()
    assert len(log) == 1 + 2 * 3


def test_chained_loop_runs_every_call_in_turn_and_carries_the_output_into_the_next():
    log: list[str] = []
    w = jnp.arange(12.0).reshape(4, 3)
    x = {"a": jnp.ones((2, 4), jnp.bfloat16), "codes": jnp.full((2, 4), 7, jnp.uint8)}

    def fn(scale, inputs):
        jax.debug.callback(lambda: log.append("call"), ordered=True)
        return inputs["a"].astype(jnp.float32) @ (scale * w)

    loop = jax.jit(timing.chained_loop(fn, (1.0, x), 6, unroll=3, carry_arg=1))
    a, codes = loop(1.0, *jax.tree.leaves(x))
    jax.effects_barrier()
    assert log == ["call"] * 6
    # A finite output adds 0: the inputs come out as they went in.
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.ones((2, 4)))
    np.testing.assert_array_equal(np.asarray(codes), np.full((2, 4), 7))
    # A NaN output reaches the carried float leaf at index 0 only: each call depends on the last.
    a, codes = loop(jnp.nan, *jax.tree.leaves(x))
    a = np.asarray(a, np.float32)
    assert np.isnan(a[0, 0]) and not np.isnan(a.reshape(-1)[1:]).any()
    for bad in ({"reps": 5, "unroll": 2}, {"reps": 0, "unroll": 1}, {"reps": 4, "unroll": 0}):
        with pytest.raises(ValueError, match="positive multiple of unroll"):
            timing.chained_loop(fn, (1.0, x), **bad)
    with pytest.raises(ValueError, match="carry_arg 2 is not one of the 2 arguments"):
        timing.chained_loop(fn, (1.0, x), 2, carry_arg=2)


def test_time_in_device_loop_divides_one_loop_by_its_calls(monkeypatch):
    timed = []

    def fake_time_fn(f, *args, **kwargs):
        timed.append((len(args), kwargs))
        return 0.5

    monkeypatch.setattr(timing, "time_fn", fake_time_fn)
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    t = timing.time_in_device_loop(lambda a, b: a @ b, (x, w), 10, unroll=5, trials=3)
    assert t == 0.05 and timed == [(2, {"inner": 1, "trials": 3, "warmup": 1, "smoke": False})]
    out = timing.loop_floor_fn({"p": jnp.full((2, 2), 3, jnp.uint8)})
    assert out.dtype == jnp.float32 and out.tolist() == [3.0]


def test_device_loop_times_sizes_each_loop_and_adds_the_floor(monkeypatch):
    timed = {}

    def fake(fn, args, reps, *, unroll, carry_arg, smoke):
        key = "floor" if fn is timing.loop_floor_fn else args[0]
        timed[key] = (reps, unroll, carry_arg, smoke)
        return 1.0 / reps

    monkeypatch.setattr(timing, "time_in_device_loop", fake)
    calls = {"fast": (None, ("fast", 0)), "slow": (None, ("slow", 0))}
    out = timing.device_loop_times(
        calls, "x", loop_seconds=1.0, unroll=4, per_call_s={"fast": 0.01, "slow": 0.3},
        carry_arg=1,
    )  # fmt: skip
    # About a second of calls a loop, whole iterations of 4; the floor sized as the fastest call.
    assert timed == {
        "fast": (100, 4, 1, False), "slow": (4, 4, 1, False), "floor": (100, 4, 0, False),
    }  # fmt: skip
    assert out == {"fast": 0.01, "slow": 0.25, timing.LOOP_FLOOR: 0.01}
    one = timing.device_loop_times(calls, "x", loop_seconds=1.0, unroll=2, per_call_s=0.5)
    assert set(one) == {"fast", "slow", timing.LOOP_FLOOR} and timed["slow"][0] == 2
    # A carried argument per call: the key's index, 0 for a key the mapping lacks.
    timing.device_loop_times(
        calls, "x", loop_seconds=1.0, unroll=2, per_call_s=0.5, carry_arg={"slow": 1}
    )
    assert (timed["fast"][2], timed["slow"][2], timed["floor"][2]) == (0, 1, 0)


def _loop_computations_calling(fn, args, carry_arg, opcode):
    """Names of the compiled chained loop's computations that call a fusion holding `opcode`."""
    loop = timing.chained_loop(fn, args, 4, carry_arg=carry_arg)
    hlo = jax.jit(loop).lower(*jax.tree.leaves(args)).compile().as_text()
    computations = re.split(r"\n(?=\S)", hlo)
    fused = [c.split(" ")[0] for c in computations if f" {opcode}(" in c]
    return {c.split(" ")[0] for c in computations if any(f"calls={f}" in c for f in fused)}


def test_a_loop_keeps_work_on_its_carried_argument_and_hoists_the_rest():
    # Why the grouped matmul benchmark carries the packed weights through the predecoded
    # kernels' loops: a decode of an argument the loop does not carry runs once, outside it.
    def decode_then_matmul(x, codes):
        return x @ jnp.exp(codes.astype(jnp.float32)).astype(jnp.bfloat16)

    args = (jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 32), jnp.uint8))
    assert _loop_computations_calling(decode_then_matmul, args, 0, "exponential") == {"ENTRY"}
    inside = _loop_computations_calling(decode_then_matmul, args, 1, "exponential")
    assert inside and "ENTRY" not in inside
