"""Result files: provenance (with the GPU's clocks when there is one) and reading rows back."""

from __future__ import annotations

import json
import subprocess
import types

import pytest

from experiments import harness

SMI_LINE = "1755 MHz, 1980 MHz, 3201 MHz, 61, 412.50 W\n"


def _fake_smi(stdout: str = SMI_LINE, error: Exception | None = None):
    def run(cmd, **kw):
        assert cmd[0] == "nvidia-smi" and kw["timeout"] > 0
        if error is not None:
            raise error
        return types.SimpleNamespace(stdout=stdout)

    return run


def test_gpu_state_parses_nvidia_smi(monkeypatch):
    monkeypatch.setattr(harness.subprocess, "run", _fake_smi())
    assert harness.gpu_state() == {
        "clocks.sm": "1755 MHz",
        "clocks.max.sm": "1980 MHz",
        "clocks.mem": "3201 MHz",
        "temperature.gpu": "61",
        "power.draw": "412.50 W",
    }


@pytest.mark.parametrize(
    "fake",
    [
        _fake_smi(error=FileNotFoundError("nvidia-smi")),
        _fake_smi(error=subprocess.CalledProcessError(9, "nvidia-smi")),
        _fake_smi(error=subprocess.TimeoutExpired("nvidia-smi", 10)),
        _fake_smi(stdout=""),
        _fake_smi(stdout="1755 MHz, 1980 MHz\n"),  # fields missing: not half a state
    ],
)
def test_gpu_state_none_without_a_readable_gpu(monkeypatch, fake):
    monkeypatch.setattr(harness.subprocess, "run", fake)
    assert harness.gpu_state() is None


def test_written_results_carry_the_gpu_state_on_a_gpu(tmp_path, monkeypatch):
    rows = [{"a": 1.5}]
    paths = harness.write_results("cpu", rows, title="T", table="|a|", outdir=str(tmp_path))
    meta = json.loads(open(paths["json"]).read())["meta"]
    assert "gpu_state_at_write" not in meta  # the CPU: nothing asked
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
    monkeypatch.setattr(harness.jax, "devices", lambda: [gpu])
    monkeypatch.setattr(harness.subprocess, "run", _fake_smi())
    paths = harness.write_results("gpu", rows, title="T", table="|a|", outdir=str(tmp_path))
    saved = json.loads(open(paths["json"]).read())
    assert saved["meta"]["device"].startswith("gpu: NVIDIA H200")
    assert saved["meta"]["gpu_state_at_write"]["clocks.sm"] == "1755 MHz"
    assert saved["rows"] == rows
    md = open(paths["md"]).read()
    assert "- GPU when written: clocks.sm 1755 MHz, clocks.max.sm 1980 MHz" in md


def test_rows_written_by_checks_the_producer_keys(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": [{"x": 1, "y": 2}, {"x": 3, "y": 4}]}))
    assert harness.rows_written_by(str(path), "m", ("x", "y"))[1] == {"x": 3, "y": 4}
    path.write_text(json.dumps({"rows": [{"x": 1, "y": 2}, {"x": 3}]}))
    with pytest.raises(ValueError, match=r"not a result written by m \(rows lack \['y'\]\)"):
        harness.rows_written_by(str(path), "m", ("x", "y"))
    path.write_text(json.dumps({"meta": {}}))
    with pytest.raises(ValueError, match="not a result written by m"):
        harness.rows_written_by(str(path), "m", ("x",))


def test_write_table_writes_the_rows_with_their_own_table(tmp_path):
    rows = [{"op": "a", "ms": 1.23456, "extra": 1}, {"op": "b", "ms": 2.0}]
    table = harness.write_table(
        "t", rows, ["op", "ms"], title="T", notes="N", fmt=".2f", outdir=str(tmp_path),
        extra={"summary": {"best": "a"}},
    )  # fmt: skip
    assert table == "| op | ms |\n|---|---|\n| a | 1.23 |\n| b | 2.00 |"
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["rows"] == rows and saved["summary"] == {"best": "a"}
    md = (tmp_path / "t.md").read_text()
    assert md.startswith("# T\n") and md.endswith(f"\n{table}\n\nN\n")
