r"""Which layers to guide, per byte of guidance, as the model gets deeper: random `tiny` policies
on random prompts (CPU scale).

  python -m experiments.guided_layer_study                           # tiny at 8, 16, 32 layers
  python -m experiments.guided_layer_study --config.depths=8 --config.gap.batch=16
  python -m experiments.guided_layer_study --config.model.preset=small --config.depths=8,16 \
      --config.rl.max_new_tokens=256                                 # GPU

Each depth of `depths` (empty: `model.n_layers`) is one policy (`model` at `seed`, larger
`init_std`: peakier distributions) sampling one FP4 rollout of `gap.batch` random prompts of up to
`gap.prompt_len` tokens and `rl.max_new_tokens` new tokens at `rl.temperature`, in the recipe
`rl.format`; the trainer replays its routing as `rl.routing_replay` says
(`trace_jax.tables.layer_study`).
"""

import ml_collections

from trace_jax.rl.config_dict import section_config_dict
from trace_jax.rl.experiment import experiment_config_dict
from trace_jax.tables.gap import GapConfig


def get_config() -> ml_collections.ConfigDict:
    c = experiment_config_dict(
        model={"preset": "tiny", "init_std": 0.08, "n_layers": 8},
        rl={"format": "nvfp4", "max_new_tokens": 64, "temperature": 1.0},
    )
    c.gap = section_config_dict(GapConfig, batch=8)
    c.depths = (8, 16, 32)  # decoder-block counts, one policy each
    return c
