r"""GRPO step time of TRACE against plain FP4 rollouts on the `small` preset.

  python -m experiments.rl_step_time --workdir=/tmp/steptime                 # one H200
  python -m experiments.rl_step_time --workdir=/tmp/steptime --gpus=0,1      # one GPU each
  python -m experiments.rl_step_time --config=configs/rl_step_time.py:smoke \
      --workdir=/tmp/steptime_smoke --outdir=/tmp/steptime_smoke           # CPU: every stage

The RL step of `configs/small_gpu.py` (32 prompts x 8 samples of 128 new tokens, two
mini-batches; rollouts on the Pallas kernels of a GPU: `rl.rollout_implementation="auto"`), 20
steps per method, the first 2 (compilation) left out: at the 0.56-0.77 s per step measured on
the H200 (experiments/results/rl_step_time.md) plus the compilation, `trace` and `fp4_qat` one
after the other should take about 4 minutes on one H200.

`smoke`: the quickstart's smoke RL run (`configs/quickstart.py:smoke`: the 2-block `tiny`
model, 2 prompts x 2 samples of 8 tokens), 2 steps per method, the first left out: every stage
of the entry point on the CPU. Its steps are the quickstart smoke run's own, so the test suite
compiles them once for both.
"""

import ml_collections

from configs import quickstart, small_gpu
from trace_jax.rl.config_dict import section_config_dict
from trace_jax.tables.step_time import StepTimeConfig


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if arg == "smoke":
        c = quickstart.get_config("smoke")
        del c.quickstart
        c.step_time = section_config_dict(StepTimeConfig, steps=c.rl.steps, skip=1)
        return c
    if arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    c = small_gpu.get_config()
    c.step_time = section_config_dict(StepTimeConfig, steps=20, skip=2)
    return c
