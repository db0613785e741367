# Settings shared by the detached-job scripts (sourced).
JOBS=${JOBS:-/tmp/jobs}
PY=${PY:-python3}
TABLES=${TABLES:-configs/table7_ptq.py,configs/table5_layers.py}
export PYTHONPATH=/tmp/site:$JOBS/repo PYTHONUNBUFFERED=1
# A process that exited but was not yet reaped is a zombie: not alive.
alive_pid() { [ -n "$1" ] && [ -d "/proc/$1" ] && ! grep -q '^State:.*Z' "/proc/$1/status"; }
queue_alive() { alive_pid "$(cat "$JOBS/queue.pid" 2>/dev/null)"; }
# An AFTER script's step: `python -m <args>` under a time limit, its log in $JOBS/out/<log>.log.
run() {  # run <seconds> <log name> <python -m args...>
  local limit=$1 log=$2; shift 2
  echo "$(date -u +%T) $log"
  timeout "$limit" $PY -m "$@" > "$JOBS/out/$log.log" 2>&1
  echo "$log rc=$?"
}
