#!/bin/bash
# Table 7's PTQ evaluation on the GPU the runs train on: the BF16 part as soon as the three
# bf16 runs ended well, the TRACE part once the three trace runs did (ptq_table reuses the
# first part). Up to 3 attempts each; writes $JOBS/ptq_rc.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
cd "$JOBS/repo" || exit 1
R=$JOBS/tables; P=$R/table7_policies
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the GPU is shared with the training runs
done_run() {
  for k in 0 1 2; do
    grep -q "\"end\": \"table7_policies/$1/seed$k\", \"rc\": 0" "$R/queue.jsonl" 2>/dev/null || return 1
  done
}
wait_for() { while ! done_run "$1"; do queue_alive || { done_run "$1"; return; }; sleep 10; done; }
ptq() {  # $1: stage name, then more flags
  local stage=$1; shift
  for a in 1 2 3; do
    echo "$(date -u +%T) ptq $stage attempt $a"
    # shellcheck disable=SC2086
    $PY -m experiments.ptq_table --config=configs/table7_ptq.py \
      --bf16_policy="$P/bf16/seed0,$P/bf16/seed1,$P/bf16/seed2" "$@" $EXTRA --outdir="$JOBS/out" \
      > "$JOBS/out/ptq_$stage.$a.log" 2>&1 && return 0
    tail -5 "$JOBS/out/ptq_$stage.$a.log"
  done
  return 1
}
rc=1
if wait_for bf16; then ptq bf16; echo "$(date -u +%T) bf16 stage rc=$?"; else echo "bf16 runs did not finish"; fi
if wait_for trace; then
  ptq trace --trace_policy="$P/trace/seed0,$P/trace/seed1,$P/trace/seed2"; rc=$?
else
  echo "trace runs did not finish"
fi
echo "$(date -u +%T) ptq rc=$rc"; echo $rc > "$JOBS/ptq_rc"
