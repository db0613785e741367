#!/bin/bash
# After a long-response pilot's queue (`AFTER=scripts/detached_jobs/after_pilot.sh`), on the idle
# GPU: the layer study of the pilot's SFT'd policy (it did not finish in 240 or 300 s), then where
# a rollout's device time goes at the Qwen3-30B-A3B shapes (`profile_rollout`, about 90 s). Each
# under a hard time limit, results into $JOBS/out (brought back by poll.sh).
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
cd "$JOBS/repo" || exit 1
sft=$(find "$JOBS/tables" -name sft_checkpoint -type d | head -n 1)
[ -n "$sft" ] || { echo "no SFT checkpoint under $JOBS/tables"; exit 1; }
run 540 guided_layer_study experiments.guided_layer_study \
  --config=configs/guided_layer_study.py:trained --config.model.preset=small \
  --config.model.init_std=0.02 --config.model.grouped_matmul=auto --config.tasks.levels=2,3,4 \
  --config.gap.batch=64 --config.rl.max_new_tokens=256 \
  --config.checkpoints="(('SFT', '$sft'),)" --name=guided_layer_study_small_sft \
  --outdir="$JOBS/out"
run 200 profile_rollout experiments.profile_rollout --outdir="$JOBS/out"
