# Settings shared by the session scripts (sourced).
S=${S:-/tmp/session}
PY=${PY:-python3}
TABLES=${TABLES:-configs/table7_ptq.py,configs/table5_layers.py}
export PYTHONPATH=/tmp/site:$S/repo PYTHONUNBUFFERED=1
# A process that exited but was not yet reaped is a zombie: not alive.
alive_pid() { [ -n "$1" ] && [ -d "/proc/$1" ] && ! grep -q '^State:.*Z' "/proc/$1/status"; }
session_alive() { alive_pid "$(cat "$S/session.pid" 2>/dev/null)"; }
