#!/bin/bash
# Waits up to $1 s for the detached jobs (runs, PTQ, kernels) and packages $OUT/poll.tgz.
# $2 = nokernels: stop once the tables are done, and tell the kernel script to skip.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
[ -d "$JOBS/tables" ] || [ -f "$JOBS/queue.pid" ] || { echo "FRESH MACHINE"; exit 3; }
end=$((SECONDS + ${1:-540}))
[ "$2" = nokernels ] && touch "$JOBS/skip_kernels"
tables_done() { ! queue_alive && [ -f "$JOBS/ptq_rc" ]; }
while [ $SECONDS -lt $end ]; do
  if tables_done && { [ -f "$JOBS/kernels_done" ] || [ "$2" = nokernels ]; }; then
    echo "jobs finished"; break
  fi
  sleep 10
done
date -u
if tables_done; then echo "tables done"; else echo "tables still running"; fi
[ -f "$JOBS/ptq_rc" ] && echo "ptq rc=$(cat "$JOBS/ptq_rc")"
[ -f "$JOBS/kernels_done" ] && echo "kernels done"
if [ ! -f "$JOBS/out/runs.tgz" ] && [ -d "$JOBS/tables" ]; then
  (cd "$JOBS/repo" && $PY -c "from trace_jax.tables.bundle import bundle; bundle('$JOBS/tables', '$JOBS/out/runs_partial.tgz')")
fi
echo "--- queue.jsonl"; tail -n 45 "$JOBS/tables/queue.jsonl" 2>/dev/null
echo "--- queue.log"; grep -v "^I1\|^W1" "$JOBS/out/queue.log" | tail -n 8
echo "--- ptq watcher"; tail -n 12 "$JOBS/out/ptq_watcher.log" 2>/dev/null
echo "--- kernels"; tail -n 8 "$JOBS/out/kernels_after.log"
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv 2>/dev/null
for f in "$JOBS"/out/*.log; do grep -v "^I1" "$f" | tail -c 200000 > "$f.trim"; done
tar czf "$OUT/poll.tgz" -C "$JOBS/out" --exclude='*.log' .
ls -la "$OUT"
