r"""Guidance store round trip at a GRPO step's size (experiments/bench_guidance_store.py).

python -m experiments.bench_guidance_store                  # `small`, trace, 256 x 180 tokens
python -m experiments.bench_guidance_store --config.model.preset=tiny --config.rows=8 \
    --config.tokens=20 --config.steps=2
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict({"preset": "small"})  # ModelConfig.<preset>
    c.method = "trace"  # the RL method whose captured guidance is stored
    c.format = "nvfp4"  # its FP4 recipe
    c.rows = 256  # rollouts per step (prompts x group size)
    c.tokens = 180  # tokens per rollout (prompt + response)
    c.mini_batches = 2  # store entries per step
    c.steps = 5  # timed steps, after one warm-up step
    return c
