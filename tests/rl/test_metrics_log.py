"""MetricsLog writes the same numbers to the JSONL record and to TensorBoard event files."""

from __future__ import annotations

import json
import struct

import pytest
from tensorboardX.proto import event_pb2

from trace_jax.rl.metrics_log import MetricsLog


def _tb_scalars(directory):
    """(tag, step, value) of every scalar in the event files under `directory`."""
    out = []
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4
            for v in event.summary.value:
                out.append((v.tag, event.step, v.simple_value))
    return out


def test_jsonl_and_tensorboard_agree_and_append(tmp_path):
    with MetricsLog(str(tmp_path), "rl_metrics") as log:
        row = log.write(0, {"reward": 0.25, "loss": -1.5, "note": "x", "flag": True})
        log.write(1, {"reward": 0.5, "loss": -1.0})
    assert row == {"step": 0, "reward": 0.25, "loss": -1.5, "note": "x", "flag": True}
    with MetricsLog(str(tmp_path), "rl_metrics", append=True) as log:  # a resumed run
        log.write(2, {"reward": 0.75, "loss": -0.5})
    lines = [json.loads(x) for x in (tmp_path / "rl_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    scalars = _tb_scalars(tmp_path / "tensorboard" / "rl_metrics")
    expected = {(k, r["step"], r[k]) for r in lines for k in ("reward", "loss")}
    assert set(scalars) == expected  # strings and bools are JSONL-only
    with MetricsLog(str(tmp_path), "rl_metrics") as log:  # a fresh run truncates
        log.write(0, {"reward": 1.0})
    assert len((tmp_path / "rl_metrics.jsonl").read_text().splitlines()) == 1


def test_read_rows_and_drop_rows_from(tmp_path):
    from trace_jax.rl.metrics_log import drop_rows_from, read_rows

    path = tmp_path / "r.jsonl"
    path.write_text('{"step": 0, "a": 1.5}\n\n{"step": 1, "a": 2}\n{"step": 2, "a": 3}\n')
    assert read_rows(str(path)) == [{"step": 0, "a": 1.5}, {"step": 1, "a": 2}, {"step": 2, "a": 3}]
    assert read_rows(str(tmp_path / "none.jsonl"), missing_ok=True) == []
    with pytest.raises(FileNotFoundError):
        read_rows(str(tmp_path / "none.jsonl"))
    # A resumed run redoes steps >= 1: their rows go, earlier rows stay as they were.
    assert drop_rows_from(str(tmp_path), "r", 1) == 2
    assert read_rows(str(path)) == [{"step": 0, "a": 1.5}]
    assert drop_rows_from(str(tmp_path), "r", 1) == 0 and drop_rows_from(str(tmp_path), "x", 0) == 0
