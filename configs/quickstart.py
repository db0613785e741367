r"""The main job (`make quickstart`): one SFT start, then RL with vanilla FP4 QAT and with TRACE.

  python -m experiments.quickstart --workdir=workdir/quickstart
  python -m experiments.quickstart --config.rl.steps=20 --config.rl.eval_every=20
  python -m experiments.quickstart --config=configs/quickstart.py:smoke --workdir=/tmp/qs_smoke

The `tiny` model (4 blocks) on level-1 programs: of the three task kinds this model learns them
best, so 250 SFT steps leave it solving about a quarter of them when sampling at temperature 1
(over half greedily), with room for RL. GRPO with NVFP4 W/A/KV rollouts, 32 prompts x 4
samples a step: per step, the mean reward depends strongly on which problems were drawn, and 32
prompts average that out better than 16 x 8 at the same cost. The learning rate 2e-4 raises the
sampled reward within 40 steps without hurting greedy accuracy (3e-4 already lowers it: each
AdamW step of a noisy policy gradient moves every weight by about the rate).

`trace` guides the deeper half of the blocks (its default), where round-to-nearest misses the
most rollout codes (the mismatch grows with depth); its shallower blocks round to nearest as in
`fp4_qat`, so its code mismatch is lower but not zero.

Evaluation: pass@1 from 4 samples per problem at the rollout temperature (what RL optimizes;
greedy accuracy barely moves in 40 steps) on the 96 problems of the in-distribution split
`level1`, of which the 32 programs are the trained kind. Code mismatch is measured every 5
steps; the final policy is evaluated once.

`quickstart` (a section `ExperimentConfig` ignores): `methods`, the RL methods run from the SFT
start; `smooth_steps`, the steps averaged into the first and last reward of the table (and the
width of the plot's moving average).
"""

import ml_collections

from trace_jax.rl.experiment import experiment_config_dict

RL_STEPS = 40


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The main job; `arg="smoke"`: the 1-block model, 4 SFT steps and 2 RL steps of 2 x 2
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
    cd.quickstart = ml_collections.ConfigDict({"methods": ("fp4_qat", "trace"), "smooth_steps": 10})
    if arg == "smoke":
        cd.model.n_layers = 1  # every stage and artifact; a block less is ~30% less to compile
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
