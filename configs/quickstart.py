r"""The main job (`make quickstart`): one SFT start, then RL with vanilla FP4 QAT and with TRACE.

  python -m experiments.quickstart --workdir=workdir/quickstart
  python -m experiments.quickstart --config.rl.steps=10 --config.rl.eval_every=10
  python -m experiments.quickstart --config=configs/quickstart.py:smoke --workdir=/tmp/qs_smoke

The `tiny` model (4 blocks) on level-1 problems of every task kind. GRPO with NVFP4 W/A/KV
rollouts, 16 prompts x 8 samples a step and a learning rate that raises the smoothed reward of
this model within the run on a 2-core CPU (lower rates barely move it; 1e-3 lowers it: each
AdamW step of a noisy policy gradient moves every weight by about the rate). Evaluation: greedy
pass@1 on all 96 problems of the in-distribution split only (the harder splits are beyond a
model this size). Code mismatch is measured every 5 steps; the final policy is evaluated once.

`quickstart` (ignored by `ExperimentConfig`): `methods`, the RL methods run from the SFT start;
`smooth_steps`, the steps averaged into the first and last reward of the table (a moving
average of that width in the plot).
"""

import ml_collections

from trace_jax.rl.experiment import experiment_config_dict

RL_STEPS = 50


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The main job; `arg="smoke"`: the 2-block model, 4 SFT steps and 2 RL steps of 2 x 2
    samples (every stage and artifact in a minute or two, nothing learned)."""
    cd = experiment_config_dict(
        tasks={"kinds": ("program",)},
        sft={"steps": 250},
        eval={
            "splits": ("level1",),
            "problems_per_split": 96,
            "k": 4,
            "temperature": 1.0,
            "max_new_tokens": 24,
        },
        rl={
            "steps": RL_STEPS,
            "prompts_per_step": 32,
            "group_size": 4,
            "learning_rate": 2e-4,
            # Level-1 solutions are at most 20 tokens with EOS.
            "max_new_tokens": 24,
            "mismatch_every": 5,
            "eval_every": RL_STEPS,
            "checkpoint_every": RL_STEPS,
        },
    )
    cd.quickstart = ml_collections.ConfigDict({"methods": ("fp4_qat", "trace"), "smooth_steps": 5})
    if arg == "smoke":
        cd.model.n_layers = 2
        cd.sft.update(steps=4, batch_size=4, warmup_steps=1, log_every=2)
        cd.eval.update(problems_per_split=3, max_new_tokens=8)
        cd.rl.update(
            steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, mismatch_every=2,
            eval_every=2, checkpoint_every=1,
        )  # fmt: skip
        cd.quickstart.smooth_steps = 1
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return cd
