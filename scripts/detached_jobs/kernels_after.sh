#!/bin/bash
# Measurements once the GPU is idle (table runs and PTQ done), or at once on GPUs of their own
# (`AFTER_GPUS`), under hard time limits: the script `$AFTER` names (a path in the repository),
# by default the decode-attention and quantize ablations.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
cd "$JOBS/repo" || exit 1
if [ -n "$AFTER_GPUS" ]; then  # GPUs of its own: at once, beside the queue
  export CUDA_VISIBLE_DEVICES=$AFTER_GPUS
else
  while queue_alive || [ ! -f "$JOBS/ptq_rc" ]; do sleep 5; done
fi
[ -f "$JOBS/skip_kernels" ] && { echo "kernels skipped"; touch "$JOBS/kernels_done"; exit 0; }
if [ -n "$AFTER" ]; then
  echo "$(date -u +%T) $AFTER"
  bash "$AFTER"
  echo "$AFTER rc=$?"
else
  echo "$(date -u +%T) ablation"
  timeout 200 $PY -m experiments.decode_attention_ablation --outdir="$JOBS/out" > "$JOBS/out/ablation.log" 2>&1
  echo "ablation rc=$?"
  timeout 150 $PY -m experiments.quantize_ablation --outdir="$JOBS/out" > "$JOBS/out/quantize_ablation.log" 2>&1
  echo "quantize ablation rc=$?"
fi
echo "$(date -u +%T) kernels done"; touch "$JOBS/kernels_done"
