r"""Where a rollout's device time goes, kernel by kernel (experiments/profile_rollout.py): the
model and variants of configs/rollout_throughput.py, one row profiled.

python -m experiments.profile_rollout        # on a GPU: about 3 minutes (compiles dominate)
python -m experiments.profile_rollout --config.row="(256, 1024, 32)"
python -m experiments.profile_rollout --config=configs/profile_rollout.py:smoke   # CPU plumbing
"""

import ml_collections

from configs import rollout_throughput


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Qwen3-30B-A3B shapes cut to 12 blocks, bf16 against FP4 at (batch 64, prompt 1024, 32 new
    tokens); `arg="smoke"`: the smoke model of configs/rollout_throughput.py."""
    c = rollout_throughput.get_config(arg)
    c.variants = ("bf16", "fp4")
    # (batch, prompt tokens, new tokens): 32 new tokens give 31 decode steps to average over and
    # keep the trace small (every kernel launch is an event)
    c.row = (64, 1024, 32)
    c.top = 15  # kernels listed per variant and phase
    c.repeats = 3  # timed rounds of the whole and the one-token rollout, for the wall times
    c.keep_traces = False  # True: the profiler's traces go to <outdir>/<name>_traces/
    if c.smoke:
        c.row, c.repeats = (2, 8, 3), 1
    return c
