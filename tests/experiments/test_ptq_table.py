"""The Table 7 entry point: the table over seeds written, workers, the redraw from JSON."""

from __future__ import annotations

import json

import pytest

from experiments import ptq_table
from tests import tiny
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables import ptq_table as library


def test_table_over_seeds_and_redraw(tmp_path, monkeypatch):
    def fake_seed_rows(config, outdir, name, seed, bf16, trace, calibration):
        assert (outdir, name, calibration) == (str(tmp_path), "t7", 3)
        rows = [{"policy": "b", "arith_countdown_l2": 0.1 * seed, "average": 0.1 * seed}]
        if trace:
            rows.append({"policy": "t", "arith_countdown_l2": 0.2 + seed, "average": 0.2 + seed})
        calls.append((seed, bf16, trace))
        return rows

    calls = []
    monkeypatch.setattr(library, "seed_rows", fake_seed_rows)
    config = ExperimentConfig.from_config_dict(tiny.experiment_config())
    kw = dict(calibration_prompts=3, outdir=str(tmp_path), name="t7")
    rows = ptq_table.run(config, bf16_policies=["a", "b"], trace_policies=["x", "y"], **kw)
    assert calls == [(0, "a", "x"), (1, "b", "y")]
    assert [r["average_seeds"] for r in rows] == [[0.0, 0.1], [0.2, 1.2]]
    saved = json.loads((tmp_path / "t7.json").read_text())["rows"]
    assert saved == json.loads(json.dumps(rows))
    assert "Table 7 analog" in (tmp_path / "t7.md").read_text()
    (tmp_path / "t7.png").unlink()  # redrawn from the JSON alone
    assert ptq_table.plot_from(str(tmp_path / "t7.json")) == str(tmp_path / "t7.png")
    assert (tmp_path / "t7.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"run": "bf16"}]}))
    with pytest.raises(ValueError, match=r"not a result written by experiments\.ptq_table"):
        ptq_table.plot_from(str(tmp_path / "other.json"))
    # A worker evaluates its one seed and writes no table.
    calls.clear()
    (tmp_path / "t7.json").unlink()
    ptq_table.run(config, bf16_policies=["a", "b"], worker_seed=1, **kw)
    assert calls == [(1, "b", "")] and not (tmp_path / "t7.json").exists()
    with pytest.raises(ValueError, match="one TRACE policy per seed"):
        ptq_table.run(config, bf16_policies=["a", "b"], trace_policies=["x"], **kw)
