r"""Scale-out on the GPUs of one host: the GRPO loop as one multi-process job, the disaggregated
rollout / trainer pair, weak scaling (`experiments.multi_gpu`).

  python -m experiments.multi_gpu                                   # every measurement
  python -m experiments.multi_gpu --config.measure=weak_scaling     # one (merged into the JSON)
  python -m experiments.multi_gpu --config=configs/multi_gpu.py:smoke --outdir=/tmp/mg  # CPU

The RL step is `configs/small_gpu.py`'s (`small`, TRACE, 8 samples of 128 new tokens, two
mini-batches), without evaluations, mismatch steps or checkpoints between the first and last
step: only the steady loop. `prompts_per_gpu` prompts a step per GPU: the parity runs train
`prompts_per_gpu x gpus` prompts a step on one GPU, on every GPU from one process, and on every
GPU from one process each (`expert_parallel`: the last two with the routed experts split over
the GPUs); weak scaling keeps `prompts_per_gpu` per GPU on 1, 2, 4, ... GPUs.
Sizing, estimated (not measured on several GPUs) from one H200's `small` TRACE step of 32 prompts
x 8 samples (0.50 s at steady state, `rl_step_time.md`) and 1-2 minutes of compilation: `parity`
about 3 x 2 minutes, `expert_parallel` 2 x 2, `disaggregated` (2 lags x 50 steps) about 4,
`weak_scaling` about 2 minutes per GPU count; one command may run 10 minutes, so measure one
section at a time (`scripts/detached_jobs/multi_gpu_section.sh`): on 2 GPUs weak scaling covers
1 and 2.

`smoke`: the same jobs on the CPU, each "GPU" a process of one host device: the 2-block `tiny`
model, 2 prompts x 4 samples of 8 tokens a GPU in two mini-batches, 3 steps (2 for the pair),
2 GPUs.
"""

import ml_collections

from trace_jax.tables.scale_out import SECTIONS


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.smoke = arg == "smoke"
    c.experiment = "configs/small_gpu.py"
    # Every job: TRACE, the steady loop only (no evaluation, mismatch steps or checkpoints
    # before the last step).
    c.overrides = (
        "rl.method=trace",
        "rl.eval_every=0",
        "rl.mismatch_every=0",
        "rl.checkpoint_every=1000",
    )
    c.measure = SECTIONS
    c.gpus = 0  # 0: every visible GPU
    c.prompts_per_gpu = 8
    c.steps = 12
    c.skip = 2  # compilation
    c.disaggregated_steps = 50
    c.lags = (0, 1)
    c.exchange = ""  # "": a directory in the workdir; or an s3:// / file:// URL
    c.timeout_s = 560
    if arg == "smoke":
        c.experiment = "configs/tiny_cpu.py"
        c.overrides = (
            *c.overrides,
            "model.n_layers=2",
            "rl.max_new_tokens=8",
            "rl.mini_batches=2",  # as the GPU jobs: each process writes and checks parts
        )
        c.gpus = 2
        c.prompts_per_gpu = 2
        c.steps = 3
        c.skip = 1
        c.disaggregated_steps = 2
        c.timeout_s = 300
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
