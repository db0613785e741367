#!/bin/bash
# After a queue (`AFTER=scripts/detached_jobs/after_untimed_kernels.sh`), on the idle GPU: the
# kernels built and not yet timed, shortest first. The prefill chunks' flash attention against
# XLA's; the grouped expert matmul at its default tiles (the FP4 kernel also in its untimed decode
# layouts, `weights_left` and `split_by_scale_block`, and beside its twin that decodes the
# weights before the call, `*_predecoded`); where an 8K-prompt rollout's prefill time goes
# (bf16, FP4, FP4 with the flash prefill); whole 8K-prompt rollouts with and without the flash
# prefill; the FP4 decode ablation's bodies with the weights as the dots' left operand. Each under
# a hard time limit, results into $JOBS/out.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
cd "$JOBS/repo" || exit 1
FLASH="('bf16', 'bf16 + flash prefill', 'fp4', 'fp4 + flash prefill')"
run 240 kernels_prefill_attention experiments.bench_prefill_attention --outdir="$JOBS/out"
run 300 kernels_moe_matmul experiments.bench_moe_matmul \
  --config=configs/bench_moe_matmul.py:default_tiles --outdir="$JOBS/out"
run 360 profile_rollout_8k experiments.profile_rollout --config.row="(64, 8192, 8)" \
  --config.repeats=1 --config.variants="('bf16', 'fp4', 'fp4 + flash prefill')" \
  --outdir="$JOBS/out" --name=profile_rollout_8k
run 540 rollout_throughput_flash_prefill experiments.rollout_throughput \
  --config.rows="((64, 8192, 256),)" --config.repeats=1 --config.variants="$FLASH" \
  --outdir="$JOBS/out" --name=rollout_throughput_flash_prefill
run 240 moe_matmul_ablation_loop experiments.moe_matmul_ablation \
  --config.variants="('stream','f16asm','f16asm_wl','bf16w','bf16w_wl')" \
  --config.no_hints="()" --config.split_k="()" --config.experts_per_program="()" \
  --name=moe_matmul_ablation_loop --outdir="$JOBS/out"
