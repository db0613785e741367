r"""Train/rollout FP4 code mismatch on synthetic activations, with and without rollout guidance
(experiments/mismatch_analysis.py).

python -m experiments.mismatch_analysis
python -m experiments.mismatch_analysis --config.formats=nvfp4 --config.eps=1e-3,1e-2
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.eps = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)  # relative train/rollout perturbations
    c.formats = ("nvfp4", "mxfp4", "mxfp8")
    c.rows = 2048  # tokens per tensor
    c.cols = 1024  # channels per token (a multiple of 32)
    c.seed = 0
    return c
