r"""The train-rollout gap on a random `tiny` policy with random prompts (CPU scale).

  python -m experiments.train_rollout_gap
  python -m experiments.train_rollout_gap --config.model.preset=small --config.gap.batch=16 \
      --config.rl.max_new_tokens=256

The policy is `model` at `seed` (larger `init_std`: peakier distributions, so FP4 rounding moves
the sampled tokens' log-probs measurably), or the trained policy `rl.init_from` on task prompts of
`tasks.levels`; the recipe `rl.format` with guidance on `rl.guided_layers`; sampling by
`rl.max_new_tokens` and `rl.temperature`; `gap`: the batch (`trace_jax.tables.gap.GapConfig`).
"""

import ml_collections

from trace_jax.rl.config_dict import section_config_dict
from trace_jax.rl.experiment import experiment_config_dict
from trace_jax.tables.gap import GapConfig


def get_config() -> ml_collections.ConfigDict:
    c = experiment_config_dict(
        model={"preset": "tiny", "init_std": 0.08},
        rl={"format": "nvfp4", "guided_layers": "half", "max_new_tokens": 48, "temperature": 1.0},
        tasks={"levels": (1,)},
    )
    c.gap = section_config_dict(GapConfig)
    return c
