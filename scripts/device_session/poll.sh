#!/bin/bash
# Waits up to $1 s for the session (runs, PTQ, kernels) and packages $OUT/poll.tgz.
# $2 = nokernels: stop once the tables are done, and tell the kernel script to skip.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
[ -d "$S/tables" ] || [ -f "$S/session.pid" ] || { echo "FRESH MACHINE"; exit 3; }
end=$((SECONDS + ${1:-540}))
[ "$2" = nokernels ] && touch "$S/skip_kernels"
tables_done() { ! session_alive && [ -f "$S/ptq_rc" ]; }
while [ $SECONDS -lt $end ]; do
  if tables_done && { [ -f "$S/kernels_done" ] || [ "$2" = nokernels ]; }; then
    echo "jobs finished"; break
  fi
  sleep 10
done
date -u
if tables_done; then echo "tables done"; else echo "tables still running"; fi
[ -f "$S/ptq_rc" ] && echo "ptq rc=$(cat "$S/ptq_rc")"
[ -f "$S/kernels_done" ] && echo "kernels done"
if [ ! -f "$S/out/runs.tgz" ] && [ -d "$S/tables" ]; then
  (cd "$S/repo" && $PY -c "from experiments import table_session as t; t.bundle('$S/tables', '$S/out/runs_partial.tgz')")
fi
echo "--- session.jsonl"; tail -n 45 "$S/tables/session.jsonl" 2>/dev/null
echo "--- session.log"; grep -v "^I1\|^W1" "$S/out/session.log" | tail -n 8
echo "--- ptq watcher"; tail -n 12 "$S/out/ptq_watcher.log" 2>/dev/null
echo "--- kernels"; tail -n 8 "$S/out/kernels_after.log"
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv 2>/dev/null
for f in "$S"/out/*.log; do grep -v "^I1" "$f" | tail -c 200000 > "$f.trim"; done
tar czf "$OUT/poll.tgz" -C "$S/out" --exclude='*.log' .
ls -la "$OUT"
