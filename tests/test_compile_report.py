"""The suite's compile report: per-test sums of JAX's compile events and their summary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.compile_report import Recorder, summary

BACKEND = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"


def test_records_split_events_by_test_and_list_long_compilations():
    rec = Recorder()
    with rec.measure("tests/a.py::one"):
        rec.listen(BACKEND, 2.0, fun_name="jit(generate)")
        rec.listen(BACKEND, 0.1, fun_name="jit(add)")  # summed, not listed
        rec.listen(TRACE, 0.5, fun_name="jit(generate)")
        rec.listen("/jax/other_event", 9.0)  # not a compile event
    with rec.measure("tests/b.py::two"):
        rec.listen(BACKEND, 1.0, fun_name="jit(generate)")
    one, two = rec.records
    assert (one["test"], one["compile_s"], one["trace_s"], one["lower_s"]) == (
        "tests/a.py::one",
        2.1,
        0.5,
        0.0,
    )
    assert one["programs"] == [("jit(generate)", 2.0)] and two["programs"] == [
        ("jit(generate)", 1.0)
    ]
    assert two["compile_s"] == 1.0 and two["trace_s"] == 0.0
    text = summary(rec.records)
    assert "2 tests" in text and "XLA compile 3 s (3 s in compilations" in text
    assert "    3.0             2  jit(generate)" in text.splitlines()


def test_a_real_compilation_is_recorded():
    rec = Recorder()
    jax.monitoring.register_event_duration_secs_listener(rec.listen)
    try:
        with rec.measure("t"):
            jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0).lower(jnp.ones(7)).compile()
    finally:
        jax.monitoring.unregister_event_duration_listener(rec.listen)
    (record,) = rec.records
    assert record["compile_s"] > 0 and record["lower_s"] > 0
    assert record["wall_s"] >= record["compile_s"]


def test_summary_without_records_is_an_error(tmp_path):
    from tests import compile_report

    with pytest.raises(SystemExit, match="no records"):
        compile_report.main(["compile_report", str(tmp_path)])
