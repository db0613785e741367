"""The Table 7 driver on `tiny`: every recipe evaluated with FP4 execution, policies loaded from
saved params and from an RL workdir."""

from __future__ import annotations

import json

import numpy as np

from configs import tiny_cpu
from experiments import main as rl_main
from experiments import ptq_table, sft
from trace_jax.models import init_model
from trace_jax.quant import ptq


def test_ptq_table_rows(tmp_path):
    cfg = tiny_cpu.get_config()
    cfg.eval.update(splits=("level1", "aime24"), problems_per_split=2, max_new_tokens=6)
    cfg.rl.update(
        steps=1, prompts_per_step=2, group_size=2, max_new_tokens=6, eval_every=0, mismatch_every=0
    )
    params = str(tmp_path / "bf16_params")
    sft.save_params(init_model(sft.model_config(cfg), seed=cfg.seed), params)
    rl_main.run(cfg, str(tmp_path / "trace_run"))
    rows = ptq_table.run(
        cfg,
        bf16_policy=params,
        trace_policy=str(tmp_path / "trace_run"),
        calibration_prompts=4,
        outdir=str(tmp_path / "out"),
        name="t7",
    )
    assert [r["policy"].split(",")[0] for r in rows] == [
        "BF16-trained",
        *(f"BF16-trained + {r} PTQ" for r in ptq.RECIPES),
        "TRACE final policy",
    ]
    for r in rows:
        assert 0.0 <= r["average"] <= 1.0
        assert np.isclose(r["average"], np.mean([r["level1"], r["aime24"]]))
    errors = {r["policy"]: r["weight_sq_error"] for r in rows if "weight_sq_error" in r}
    assert len(errors) == 3 and all(e > 0 for e in errors.values())
    saved = json.loads((tmp_path / "out" / "t7.json").read_text())
    assert len(saved["rows"]) == 5
    assert "Table 7 analog" in (tmp_path / "out" / "t7.md").read_text()


def test_missing_policy_is_a_clear_error(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="no policy at"):
        ptq_table.load_policy(tiny_cpu.get_config(), str(tmp_path / "nowhere"))
