r"""Table 1 analog in the long-response regime: NVFP4 W/A/KV rollouts, every method, `small`, on
loop programs whose worked solutions run 192-2048 tokens (`trace_jax.tasks.loop`).

  TABLES=configs/table1_long.py PER_GPU=6 MEM_FRACTION=0.15 DEADLINE=600 \
      DONE_FROM=experiments/results/runs bash scripts/detached_jobs/start.sh 540   # on an H200
  python -m experiments.paper_table --config=configs/table1_long.py --workdir=workdir/table1_long
  python -m experiments.paper_table --config=configs/table1_long.py:pilot \
      --workdir=workdir/table1_long_pilot --runs=bf16,fp4_qat,trace

The table (no variant, `table1_long`): the regime the pilots found (`pilot_more_rows`: levels 2-4,
responses to 1024 tokens, 16 prompts x 8 samples a step, 60 GRPO steps at 3e-5 after 1200 SFT
steps, 96 held-out problems per split at steps 29 and 59), where fp4_qat ends 4.0-4.5 points
below BF16 in three holds, with Table 1's methods, TRACE on the deeper half and on every layer,
3 seeds: 18 runs. One H200 held for 30 minutes runs the SFT stage and six of them (one seed of
every method: the queue runs seed by seed; 562-1332 s for the six after a 3.5-minute stage, so
`DEADLINE=600` keeps a seventh run, which could not finish, from slowing them); the rest follow
in later holds with `DONE_FROM`, each hold running the SFT stage again. Two holds' stages differ
in their bits, so each seed's runs start from the stage of the hold that trained them (recorded
per run), a seed is adopted whole or finished from the new stage's start
(`trace_jax.tables.queue.check_adopted_starts`), and the table's SFT row is the mean of the
seeds' starts. `full_length`: the first design, levels 2-5 to 2048 tokens, 100 steps (one run
takes an H200 to itself for about 25 minutes, sizing below).

The short tasks' responses (at most about 100 tokens) leave no room for a per-token
train-rollout mismatch to compound over a sequence; here every rollout samples up to 2048
tokens, as the paper's reasoning rollouts do. Training and evaluation use loop programs at levels
2-5 (192-256, 384-512, 768-1024 and 1536-2048 solution tokens); the held-out splits `loop_l2`
... `loop_l5` take the benchmarks' place. A step is as hard at every level: the level sets only
how many steps a solution takes.

Sizing, one (run, seed) alone on one H200, from the Table 1 recipe's measured GRPO step
(`rl_step_time.md`: rollout 0.317 s for 256 rows x 128 new tokens, training 0.330 s for 256 rows
x 177 token slots, TRACE's guidance I/O 0.122 s):
- rollout: decoding `small` is bound by latency, not rows (about 2.5 ms a step at 256 rows); the
  longest response of a step (a level-5 problem is in 99% of 16-prompt steps) takes up to 2048
  steps: about 5 s;
- training: 16 prompts x 8 samples x (49 + 2048) slots = 268K token slots, 6x Table 1's 45K:
  2.0 s at its 7.3 us a slot, and about 1.7x that as attention grows to 2K keys (its FLOPs per
  token go from 7% to 85% of the projections'): about 3.5 s;
- TRACE's guidance I/O grows with the tokens: about 0.7 s.
So a step is about 9 s (TRACE; 8-8.5 s for the others) and 100 steps about 15 minutes, plus 2-3
minutes of compilation and two evaluations of 4 x 96 problems x 4 samples (about 15 s each):
about 20 minutes, 25 with a margin for the estimate. The trainer's dense attention keeps a
mini-batch's [32, 8, 2097, 2097] scores per layer: 4 mini-batches (32 rows each, staleness 3,
the paper's) keep its memory near 60-90 GiB, so one run takes an H200 to itself. The SFT stage
(shared by the table: 2000 steps of 16 rows of 2098 slots, about 0.4 s each) takes 10-15 minutes.

`pilot`: sized for one machine held for at most 30 minutes (the SFT stage and every run on one
H200, nothing carried over): its own SFT stage on levels 2-4 (1200 steps of 16 rows of at most
1073 slots), then every method but QaRL, 2 seeds, all eight runs sharing the GPU (8 prompts x 8
samples a step, so that the paper's 4 mini-batches hold 16 rows and a run's trainer stays near
10-15 GiB), 40 GRPO steps on responses of up to 1024 tokens at Table 1's learning rate, held-out
evaluation on `loop_l2`..`loop_l4` (48 problems x 2 samples) at steps 19 and 39.
`pilot_high_lr`: the same at 3x the learning rate (1e-4), the hypothesis' strongest single knob
besides length.
`pilot_strong_start`: `pilot` from a stronger SFT start (3600 SFT steps instead of 1200). At
`pilot`'s start the SFT loss is 0.008 nats a solution token, about 4 nats over a 500-token
solution, so a sample at temperature 1 rarely survives to a correct answer (held-out pass@1
4-17%) and half of the 8-sample groups carry no signal; in neither pilot did BF16 itself improve.
The longer stage takes about 7 of the machine's 30 minutes (it ended at the same loss, with a
better held-out start, and still no method improved: REPORT section 6).
`pilot_more_rows`: BF16 against fp4_qat alone, 16 prompts x 8 samples a step for 60 steps (3x
`pilot`'s rows per run; Table 1's short regime gains 5 points over 100 steps of 128 rows), with
96 held-out problems per split (half the evaluation noise of 48) at steps 29 and 59. Four runs of
twice `pilot`'s trainer memory: start them with `PER_GPU=4`. Estimated from `pilot_strong_start`'s
hold (eight runs of 40 x 64 rows in 12 minutes, the FP4 ones about 2.5x a bf16 run's time): about
15 minutes for the runs, 20 with the SFT stage (measured: 2 minutes of SFT, 11.5 minutes of
runs, one of them retried after running out of GPU memory).
`pilot_more_rows_all`: `pilot_more_rows` with every method but QaRL (the SFT stage differs from
one machine to the next, so every method of a comparison runs in one hold). Eight runs at four a
GPU: two rounds of about 8-9 minutes after the SFT stage, about 20-22 minutes in all (measured:
three of the eight died of GPU memory beside three co-tenants, each GRPO step asking for a
26.7 GiB buffer, and the hold ended before the second round did).
`pilot_more_rows_trace`: `pilot_more_rows` with TRACE (bf16, fp4_qat, trace x 2 seeds): the three
methods that answer the central question, in one round of six runs on one GPU (start them with
`PER_GPU=6 MEM_FRACTION=0.15`: uncapped, six ran the GPU out of memory; capped, none did, 133 GB
in use, bf16 done in 760 s and the FP4 runs at about 12-15 s a step, about 25 minutes with the
SFT stage);
`pilot_more_rows_trace_1seed` its first seed alone (three runs: a hold with about 17 minutes
left).
`pilot_no_is_cap` and `pilot_mxfp4_w4a4`: `pilot_more_rows_trace` with the truncated importance
weight turned off (`rl.is_cap=None`: no correction for the rollout's FP4 log-probs) and with
MXFP4 weights and activations (W4A4; the hypothesis' coarser format), six runs each.

Every FP4 run's evaluations score its policy run in bf16 as well (`eval.in_bf16_too`,
`average@bf16` in the table): in the pilots the same SFT policy solves up to 3 points fewer
held-out problems in NVFP4 than in bf16, so an FP4 method's score mixes what training did to its
policy with what FP4 execution costs it; the bf16 score is the first alone.

Every variant recomputes each block's activations in the backward pass (`model.remat`): a
training mini-batch of 32 rows x 1073 slots keeps one block's attention scores instead of eight
(one GRPO step's XLA temporaries on the CPU: 46.0 -> 18.6 GiB), so six to eight runs share a GPU.
"""

import ml_collections

from configs import small_gpu
from trace_jax.tables.grid import table_section

LOOP_SPLITS = ("loop_l2", "loop_l3", "loop_l4", "loop_l5")
METHODS = ("bf16", "fp4_qat", "qarl", "quads", "trace", "trace all")
MAX_SOLUTION_TOKENS = 2048  # level 5's band ends here (EOS included)
# variant: what it changes in `pilot` (learning rate, SFT steps, GRPO steps, prompts a step,
# methods, held-out problems per split, seeds)
PILOT = dict(
    learning_rate=3e-5,
    sft_steps=1200,
    rl_steps=40,
    prompts_per_step=8,
    methods=("bf16", "fp4_qat", "quads", "trace"),
    eval_problems=48,
    seeds=(0, 1),
)
PILOTS = {
    "pilot": PILOT,
    "pilot_high_lr": {**PILOT, "learning_rate": 1e-4},
    "pilot_strong_start": {**PILOT, "sft_steps": 3600},
    "pilot_more_rows": {
        **PILOT,
        "rl_steps": 60,
        "prompts_per_step": 16,
        "methods": ("bf16", "fp4_qat"),
        "eval_problems": 96,
    },
}
PILOTS["pilot_more_rows_all"] = {
    **PILOTS["pilot_more_rows"],
    "methods": ("bf16", "fp4_qat", "quads", "trace"),
}
PILOTS["pilot_more_rows_trace"] = {
    **PILOTS["pilot_more_rows"],
    "methods": ("bf16", "fp4_qat", "trace"),
}
PILOTS["pilot_more_rows_trace_1seed"] = {**PILOTS["pilot_more_rows_trace"], "seeds": (0,)}
# Two knobs of the hypothesis at `pilot_more_rows_trace`'s setting (`overrides`: of every run).
PILOTS["pilot_no_is_cap"] = {**PILOTS["pilot_more_rows_trace"], "overrides": {"rl.is_cap": None}}
PILOTS["pilot_mxfp4_w4a4"] = {
    **PILOTS["pilot_more_rows_trace"],
    "overrides": {"rl.format": "mxfp4_w4a4"},
}


# The table in the regime the pilots found: `pilot_more_rows` with Table 1's methods and TRACE
# on every layer as well, 3 seeds.
TABLE = {**PILOTS["pilot_more_rows"], "methods": METHODS, "seeds": (0, 1, 2)}


def run_overrides(label: str, more: dict | None = None) -> dict:
    """A run label's config overrides: `<method>` (TRACE: the deeper half guided) or
    `trace all` (every layer guided); NVFP4 W/A/KV rollouts unless `more` (overrides of every
    run of the table) says otherwise."""
    method, _, layers = label.partition(" ")
    overrides = {"rl.method": method, "rl.format": "nvfp4"}
    if layers:
        overrides["rl.guided_layers"] = layers
    return {**overrides, **(more or {})}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The long-regime Table 1 (`TABLE`); `arg`: `full_length`, or a one-machine pilot
    (`PILOTS`, docstring)."""
    c = small_gpu.get_config()
    c.tasks.update(kinds=("loop",), levels=(2, 3, 4, 5))
    c.sft.update(steps=2000, batch_size=16, learning_rate=1e-3, warmup_steps=100, log_every=100)
    c.eval.update(
        splits=LOOP_SPLITS,
        problems_per_split=96,
        k=4,
        temperature=1.0,
        max_new_tokens=MAX_SOLUTION_TOKENS,
    )
    c.rl.update(
        steps=100,
        prompts_per_step=16,
        group_size=8,
        max_new_tokens=MAX_SOLUTION_TOKENS,
        learning_rate=3e-5,  # Table 1's (not tuned)
        warmup_steps=10,
        mini_batches=4,
        eval_every=50,
        checkpoint_every=25,
        mismatch_every=25,
    )
    c.model.remat = True  # docstring: long rows
    c.eval.in_bf16_too = True  # docstring: FP4 execution apart from training
    more = {}
    if arg == "full_length":
        name, seeds, methods = "table1_long_full_length", (0, 1, 2), METHODS[:5]
    elif arg is None or arg in PILOTS:
        p = PILOTS[arg] if arg else TABLE
        name = f"table1_long_{arg}" if arg else "table1_long"
        seeds, methods, more = p["seeds"], p["methods"], p.get("overrides", {})
        c.tasks.update(levels=(2, 3, 4))
        c.sft.update(steps=p["sft_steps"])
        c.eval.update(
            splits=LOOP_SPLITS[:3], problems_per_split=p["eval_problems"], k=2, max_new_tokens=1024
        )
        half = p["rl_steps"] // 2
        c.rl.update(
            steps=p["rl_steps"],
            max_new_tokens=1024,
            learning_rate=p["learning_rate"],
            prompts_per_step=p["prompts_per_step"],
            eval_every=half,
            checkpoint_every=half,
            mismatch_every=p["rl_steps"],
        )
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; known: full_length, {sorted(PILOTS)}")
    c.table = table_section(
        name=name,
        title="Table 1 analog, long responses: NVFP4 W/A/KV rollout, pass@1 after GRPO",
        seeds=seeds,
        runs=tuple((label, run_overrides(label, more)) for label in methods),
    )
    return c
