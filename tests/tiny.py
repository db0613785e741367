"""The models the model-level tests run: the `tiny` preset cut to `N_LAYERS` decoder blocks.

Compiling the model dominates these tests on the CPU, and it grows with the block count (blocks
are unrolled); two blocks keep every per-layer path a test checks (first and last block, the
deeper half that TRACE guides by default) at about 60% of four blocks' time.
"""

from __future__ import annotations

import ml_collections

from configs import tiny_cpu
from trace_jax.models import ModelConfig

N_LAYERS = 2


def model_config(**overrides) -> ModelConfig:
    """`ModelConfig.tiny` with `N_LAYERS` blocks (other fields as `overrides` say)."""
    return ModelConfig.tiny(**{"n_layers": N_LAYERS, **overrides})


def experiment_config() -> ml_collections.ConfigDict:
    """`configs/tiny_cpu.py` with `N_LAYERS` blocks."""
    cfg = tiny_cpu.get_config()
    cfg.model.n_layers = N_LAYERS
    return cfg
