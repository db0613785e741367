#!/bin/bash
# After a long-response pilot's queue (`AFTER=scripts/detached_jobs/after_pilot.sh`), on the idle
# GPU: TRACE's GRPO step time against plain FP4 rollouts, the grouped expert matmuls at their
# default tiles, and the layer study of the pilot's SFT'd policy. Each under a hard time limit,
# results into $JOBS/out (brought back by poll.sh).
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
cd "$JOBS/repo" || exit 1
run() {  # run <seconds> <log name> <python -m args...>
  local limit=$1 log=$2; shift 2
  echo "$(date -u +%T) $log"
  timeout "$limit" $PY -m "$@" > "$JOBS/out/$log.log" 2>&1
  echo "$log rc=$?"
}
run 330 rl_step_time experiments.rl_step_time --workdir="$JOBS/steptime" --outdir="$JOBS/out"
run 150 bench_moe_matmul experiments.bench_moe_matmul \
  --config=configs/bench_moe_matmul.py:default_tiles --name=kernels_moe_matmul --outdir="$JOBS/out"
sft=$(find "$JOBS/tables" -name sft_checkpoint -type d | head -n 1)
[ -n "$sft" ] || { echo "no SFT checkpoint under $JOBS/tables"; exit 1; }
run 240 guided_layer_study experiments.guided_layer_study \
  --config=configs/guided_layer_study.py:trained --config.model.preset=small \
  --config.model.init_std=0.02 --config.model.grouped_matmul=auto --config.tasks.levels=2,3,4 \
  --config.gap.batch=64 --config.rl.max_new_tokens=512 \
  --config.checkpoints="(('SFT', '$sft'),)" --name=guided_layer_study_small_sft \
  --outdir="$JOBS/out"
