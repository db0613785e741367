#!/bin/bash
# After a queue (`AFTER=scripts/detached_jobs/after_untimed_kernels.sh`), on the idle GPU, or
# beside it on GPUs of its own (`AFTER_GPUS`): what is built and not yet timed, what decides a
# default first. Whole 8K-prompt rollouts with XLA's, the flash kernel's and cuDNN's prefill
# attention, bf16 and FP4; where an 8K-prompt rollout's prefill time goes (bf16, FP4, FP4 with
# the flash or cuDNN prefill attention); the FP4 decode ablation's bodies with the weights as
# the dots' left operand. Each under a hard time limit, results into $JOBS/out.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
cd "$JOBS/repo" || exit 1
for base in bf16 fp4; do
  run 300 rollout_throughput_prefill_$base experiments.rollout_throughput \
    --config.rows="((64, 8192, 256),)" --config.repeats=1 \
    --config.variants="('$base', '$base + flash prefill', '$base + cudnn prefill')" \
    --outdir="$JOBS/out" --name=rollout_throughput_prefill_$base
done
run 360 profile_rollout_8k experiments.profile_rollout --config.row="(64, 8192, 8)" \
  --config.repeats=1 --config.variants="('bf16', 'fp4', 'fp4 + flash prefill', 'fp4 + cudnn prefill')" \
  --outdir="$JOBS/out" --name=profile_rollout_8k
run 240 moe_matmul_ablation_loop experiments.moe_matmul_ablation \
  --config.variants="('stream','f16asm','f16asm_wl','bf16w','bf16w_wl')" \
  --config.no_hints="()" --config.split_k="()" --config.experts_per_program="()" \
  --name=moe_matmul_ablation_loop --outdir="$JOBS/out"
