"""The SFT entry point: a few steps, evaluation, checkpoint round trip."""

from __future__ import annotations

import json

import jax
import numpy as np
from flax import nnx

from experiments import sft
from tests import tiny
from trace_jax.models import init_model


def test_sft_runs_and_checkpoint_restores(tmp_path):
    cfg = tiny.experiment_config()
    cfg.sft.steps = 3
    cfg.sft.warmup_steps = 1
    cfg.sft.log_every = 1
    cfg.eval.problems_per_split = 2
    cfg.eval.splits = ("aime24",)
    cfg.eval.max_new_tokens = 8
    rows = sft.run(cfg, str(tmp_path))
    assert [r["split"] for r in rows] == list(cfg.eval.splits)
    assert all(0.0 <= r["pass@1_bf16"] <= 1.0 and 0.0 <= r["pass@1_nvfp4"] <= 1.0 for r in rows)
    lines = (tmp_path / "sft_metrics.jsonl").read_text().splitlines()
    history = [json.loads(line) for line in lines]
    assert [h["step"] for h in history] == [0, 1, 2]
    assert (tmp_path / "sft_loss.png").stat().st_size > 0
    # The checkpoint holds the trained parameters: restoring into a fresh model reproduces them.
    fresh = init_model(sft.model_config(cfg), seed=123)
    sft.load_params(fresh, str(tmp_path / "sft_checkpoint"))
    trained = init_model(sft.model_config(cfg), seed=123)
    sft.load_params(trained, str(tmp_path / "sft_checkpoint"))
    a = jax.tree.leaves(nnx.state(fresh, nnx.Param))
    b = jax.tree.leaves(nnx.state(init_model(sft.model_config(cfg), seed=cfg.seed), nnx.Param))
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))  # trained != init
    for x, y in zip(a, jax.tree.leaves(nnx.state(trained, nnx.Param)), strict=True):
        np.testing.assert_array_equal(x, y)
