"""Every config in configs/ builds and names valid presets, methods and formats."""

from __future__ import annotations

import importlib
import pathlib

import pytest

from configs import small_gpu, tiny_cpu
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


def test_model_n_layers_overrides_the_preset_when_set():
    cfg = tiny_cpu.get_config()
    assert cfg.model.n_layers is None and sft.model_config(cfg).n_layers == 4
    cfg.model.n_layers = 3
    assert sft.model_config(cfg).n_layers == 3
    big = small_gpu.get_config()
    big.model.n_layers = 2
    mcfg = sft.model_config(big)
    assert (mcfg.n_layers, mcfg.d_model) == (2, 512)  # the small preset's other fields stay
    cfg.model.n_layers = 0
    with pytest.raises(ValueError, match="n_layers"):
        sft.model_config(cfg)
