"""The quickstart chains SFT -> RL -> evaluation and reports the scores the stages measured."""

from __future__ import annotations

import json

import pytest

from experiments import quickstart
from tests import tiny


def _cfg():
    cfg = tiny.experiment_config()
    cfg.sft.update(steps=4, batch_size=4, log_every=2, warmup_steps=1)
    cfg.eval.update(splits=("level1", "aime24"), problems_per_split=3, max_new_tokens=8)
    cfg.rl.update(
        steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_every=2,
        checkpoint_every=1, mismatch_every=0,  # mismatch metrics: test_rl_main (CI time)
    )  # fmt: skip
    return cfg


def test_quickstart_end_to_end(tmp_path, monkeypatch):
    cfg = _cfg()
    # Distinct scores per stage and split (a tiny model scores 0 everywhere, which would let a
    # table that mixes up its columns pass): the table must carry each stage's own numbers.
    from experiments import main as rl_main
    from experiments import sft

    def fake_scores(offset):
        def score(model, problems, key, **kw):
            return offset + 0.01 * len(problems[0].prompt) + (0.001 if kw["mode"] != "off" else 0)

        return score

    monkeypatch.setattr(sft, "evaluate_pass_at_1", fake_scores(0.1))
    monkeypatch.setattr(rl_main, "evaluate_pass_at_1", fake_scores(0.5))
    rows = quickstart.run(cfg, str(tmp_path))
    assert [r["split"] for r in rows] == ["level1", "aime24"]
    data = json.loads((tmp_path / "quickstart.json").read_text())
    rl_eval = json.loads((tmp_path / "rl" / "rl_eval.jsonl").read_text().splitlines()[-1])
    sft_eval = json.loads((tmp_path / "sft" / "sft_eval.json").read_text())["rows"]
    after = "after 2 RL steps (trace, nvfp4)"
    for row, s in zip(data["rows"], sft_eval, strict=True):
        assert row[after] == rl_eval[row["split"]]  # the numbers the stages measured
        assert row["SFT pass@1 (bf16)"] == s["pass@1_bf16"]
        assert row["SFT pass@1 (NVFP4)"] == s["pass@1_nvfp4"] == s["pass@1_bf16"] + 0.001
        assert 0.5 < row[after] < 1.0 and 0.1 < row["SFT pass@1 (bf16)"] < 0.5
    assert [h["step"] for h in data["rl_history"]] == [0, 1]
    assert (tmp_path / "quickstart.png").stat().st_size > 0
    # A rerun reuses the SFT stage and the finished RL run.
    again = quickstart.run(cfg, str(tmp_path))
    assert again == rows


def test_final_policy_must_be_evaluated(tmp_path):
    cfg = _cfg()
    cfg.rl.eval_every = 3
    with pytest.raises(ValueError, match=r"multiple of rl\.eval_every"):
        quickstart.run(cfg, str(tmp_path))
