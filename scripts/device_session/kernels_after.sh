#!/bin/bash
# Kernel measurements once the GPU is idle (table session and PTQ done): the decode-attention
# and quantize ablations (kernels_findings items 11, 13-16), under hard time limits.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
cd "$S/repo" || exit 1
while session_alive || [ ! -f "$S/ptq_rc" ]; do sleep 5; done
[ -f "$S/skip_kernels" ] && { echo "kernels skipped"; touch "$S/kernels_done"; exit 0; }
echo "$(date -u +%T) ablation"
timeout 200 $PY -m experiments.decode_attention_ablation --outdir="$S/out" > "$S/out/ablation.log" 2>&1
echo "ablation rc=$?"
timeout 150 $PY -m experiments.quantize_ablation --outdir="$S/out" > "$S/out/quantize_ablation.log" 2>&1
echo "quantize ablation rc=$?"
echo "$(date -u +%T) kernels done"; touch "$S/kernels_done"
