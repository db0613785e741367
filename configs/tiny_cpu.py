r"""The `tiny` preset on the CPU: SFT warm start, then a short RL run (quickstart scale).

  python -m experiments.sft --config=configs/tiny_cpu.py --workdir=/tmp/trace_tiny
  python -m experiments.sft --config=configs/tiny_cpu.py --config.sft.steps=50
  python -m experiments.main --config=configs/tiny_cpu.py --workdir=/tmp/trace_tiny \
      --config.rl.init_from=/tmp/trace_tiny/sft_checkpoint --config.rl.method=trace

The library's defaults (`trace_jax.rl.experiment`) are this scale: the `tiny` model (4 blocks;
`model.n_layers` cuts it), level-1 problems of every task kind, 600 SFT steps of batch 32, 20 RL
steps of 8 prompts with the `trace` method and NVFP4 rollouts, evaluation on 48 problems of each
held-out split. This file sets what differs from them.
"""

import ml_collections

from trace_jax.rl.experiment import experiment_config_dict


def get_config() -> ml_collections.ConfigDict:
    # Four samples per prompt and a learning rate for a 0.45M-parameter model (GRPOConfig's
    # defaults are the paper's 8 and 1e-6 at 30B).
    return experiment_config_dict(rl={"group_size": 4, "learning_rate": 1e-4})
