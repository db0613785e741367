#!/bin/bash
# Kernel measurements once the GPU is idle (table session and PTQ done): the decode-attention
# ablation (kernels_findings items 11 and 13), under a hard time limit.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
cd "$S/repo" || exit 1
while session_alive || [ ! -f "$S/ptq_rc" ]; do sleep 5; done
[ -f "$S/skip_kernels" ] && { echo "kernels skipped"; touch "$S/kernels_done"; exit 0; }
echo "$(date -u +%T) ablation"
timeout 200 $PY -m experiments.decode_attention_ablation --outdir="$S/out" > "$S/out/ablation.log" 2>&1
echo "ablation rc=$?"
echo "$(date -u +%T) kernels done"; touch "$S/kernels_done"
