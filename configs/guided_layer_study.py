r"""Which layers to guide, per byte of guidance, as the model gets deeper and as it trains: random
`tiny` policies on random prompts, and trained ones on task prompts (CPU scale).

  python -m experiments.guided_layer_study                           # tiny at 8, 16, 32 layers
  python -m experiments.guided_layer_study --config.depths=8 --config.gap.batch=16
  python -m experiments.guided_layer_study --config.model.preset=small --config.depths=8,16 \
      --config.rl.max_new_tokens=256                                 # GPU

Each depth of `depths` (empty: `model.n_layers`) is one random policy (`model` at `seed`, larger
`init_std`: peakier distributions) sampling one FP4 rollout of `gap.batch` random prompts of up to
`gap.prompt_len` tokens and `rl.max_new_tokens` new tokens at `rl.temperature`, in the recipe
`rl.format`; the trainer replays its routing as `rl.routing_replay` says
(`trace_jax.tables.layer_study`). `checkpoints`: trained policies of `model` to study as well,
`(label, path)` pairs, each path an SFT checkpoint (any `save_params` directory) or an RL run's
workdir (its final step, `rl.steps - 1`); they sample task prompts of `tasks` and stop at EOS.
The trained policies are named here only: `rl.init_from` stays empty.

`trained`: a `tiny`-width model of 8 blocks on level-1 loop programs (96-128 solution tokens):
its random init beside SFT stages of 100 and 300 steps and the 300-step one after 10 GRPO steps
(training progress; at this size no sampled solution is correct, so those steps see zero reward
and move the policy by weight decay and the router's aux loss alone). The stages run from this
same config first (on one CPU core: SFT 3 and 7 minutes, GRPO 5):

  W=workdir/guided_layer_study
  python -m experiments.sft --config=configs/guided_layer_study.py:trained --workdir=$W/sft100 \
      --config.sft.steps=100
  python -m experiments.sft --config=configs/guided_layer_study.py:trained --workdir=$W/sft
  python -m experiments.main --config=configs/guided_layer_study.py:trained --workdir=$W/grpo \
      --config.rl.init_from=$W/sft/sft_checkpoint
  python -m experiments.guided_layer_study --config=configs/guided_layer_study.py:trained \
      --name=guided_layer_study_trained

At 16 blocks: `--config.model.n_layers=16` on every command, with other workdirs (e.g.
`W=workdir/guided_layer_study_16`) and `--config.checkpoints` naming them. On the CPU the batch
sets the regime: XLA:CPU computes the teacher-forced bf16 forward bit for bit as the decode only
for small forwards (8 x 80 token slots do; 16 x 80 and 8 x 144 differ by an ulp in attention), so
`--config.gap.batch=4` (4 x 176 slots) measures FP4 rounding alone, while the default 16 adds the
bf16 differences a GPU trainer has too (the BF16 pair's router agreement below 1 shows them).
The `small` preset's SFT'd policy on one H200 (`guided_layer_study_small_sft.md`, REPORT section
6): the long pilots' SFT stage (1200 steps on loop programs of levels 2-4, about 4 minutes with
its evaluation), then the study (about 8 minutes):

  python -m experiments.paper_table --config=configs/table1_long.py:pilot_more_rows_trace \
      --workdir=/tmp/w --sft_only && \
  python -m experiments.guided_layer_study --config=configs/guided_layer_study.py:trained \
      --config.model.preset=small --config.model.init_std=0.02 \
      --config.model.grouped_matmul=auto --config.tasks.levels=2,3,4 \
      --config.gap.batch=64 --config.rl.max_new_tokens=256 \
      --config.checkpoints="(('SFT', '/tmp/w/sft/sft_checkpoint'),)" \
      --name=guided_layer_study_small_sft --outdir=$OUT
"""

import ml_collections

from trace_jax.rl.config_dict import section_config_dict
from trace_jax.rl.experiment import experiment_config_dict
from trace_jax.tables.gap import GapConfig

TRAINED_WORKDIR = "workdir/guided_layer_study"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The random-policy study over depths; `arg="trained"`: the trained policies (docstring)."""
    c = experiment_config_dict(
        model={"preset": "tiny", "init_std": 0.08, "n_layers": 8},
        rl={"format": "nvfp4", "max_new_tokens": 64, "temperature": 1.0},
    )
    c.gap = section_config_dict(GapConfig, batch=8)
    c.depths = (8, 16, 32)  # decoder-block counts, one random policy each
    c.checkpoints = ()  # (label, path): trained policies of `model`
    if arg == "trained":
        c.tasks.update(kinds=("loop",), levels=(1,))
        c.sft.update(steps=300, batch_size=16, learning_rate=3e-3, warmup_steps=20, log_every=25)
        # No held-out loop split of level 1: level 2's shows whether the traces generalize.
        c.eval.update(splits=("loop_l2",), problems_per_split=4, max_new_tokens=256)
        c.rl.update(
            steps=10, prompts_per_step=8, group_size=4, learning_rate=1e-4,
            max_new_tokens=128,  # a level-1 solution with its EOS
            eval_every=10, checkpoint_every=10, mismatch_every=0,
        )  # fmt: skip
        c.gap.update(batch=16, prompt_len=48)  # loop prompts run to 48 tokens
        c.depths = ()  # the random policy at `model.n_layers`, beside the trained ones
        c.checkpoints = (
            ("SFT 100 steps", f"{TRAINED_WORKDIR}/sft100/sft_checkpoint"),
            ("SFT 300 steps", f"{TRAINED_WORKDIR}/sft/sft_checkpoint"),
            ("SFT 300 + GRPO 10", f"{TRAINED_WORKDIR}/grpo"),
        )
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'trained'")
    return c
