r"""GRPO step time of TRACE against plain FP4 rollouts on the `small` preset.

  python -m experiments.rl_step_time --workdir=/tmp/steptime --gpus=0,1
  python -m experiments.rl_step_time --config.model.preset=tiny --config.step_time.steps=6 \
      --workdir=/tmp/steptime                                        # a CPU smoke run
"""

import ml_collections

from configs import small_gpu
from trace_jax.rl.config_dict import section_config_dict
from trace_jax.tables.step_time import StepTimeConfig


def get_config() -> ml_collections.ConfigDict:
    c = small_gpu.get_config()
    c.step_time = section_config_dict(StepTimeConfig)
    return c
