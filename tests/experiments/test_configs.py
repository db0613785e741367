"""Every config in configs/ builds and names valid presets, methods and formats."""

from __future__ import annotations

import importlib
import pathlib

import pytest

from experiments import sft
from trace_jax import tasks
from trace_jax.rl.methods import FORMAT_PRESETS, METHODS, get_method

CONFIGS = sorted(
    p.stem
    for p in (pathlib.Path(__file__).parents[2] / "configs").glob("*.py")
    if p.stem != "__init__"
)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds(name):
    cfg = importlib.import_module(f"configs.{name}").get_config()
    mcfg = sft.model_config(cfg)
    assert cfg.rl.method in METHODS and cfg.rl.format in FORMAT_PRESETS
    get_method(cfg.rl.method).setup(cfg.rl.format, mcfg.n_layers)
    assert cfg.rl.prompts_per_step > 0 and cfg.rl.group_size > 1
    assert set(cfg.eval.splits) <= set(tasks.SPLIT_NAMES)
    assert sft.pad_length(cfg.tasks.levels) > 0
