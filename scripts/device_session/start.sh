#!/bin/bash
# Starts the table session, the PTQ watcher and the kernel script detached; polls for $1 s.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
[ -n "$LOCAL" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p "$S/out" "$S/repo"
# Detached jobs run from a copy: a later command's tree sync cannot touch them.
tar --exclude=./.venv --exclude=./.git --exclude=./workdir -cf - . | tar -xf - -C "$S/repo"
cd "$S/repo" || exit 1
nvidia-smi -L 2>/dev/null; date -u
setsid bash -c "echo \$\$ > $S/session.pid; exec $PY -m experiments.table_session \
  --tables=$TABLES --root=$S/tables --per_gpu=${PER_GPU:-5} --deadline_s=${DEADLINE:-1250} \
  --bundle=$S/out/runs.tgz --extra=\"$EXTRA\"" > "$S/out/session.log" 2>&1 < /dev/null &
sleep 2
if [[ $TABLES == *table7_ptq* ]]; then
  setsid bash scripts/device_session/ptq_when_ready.sh > "$S/out/ptq_watcher.log" 2>&1 < /dev/null &
else
  echo 0 > "$S/ptq_rc"
fi
setsid bash scripts/device_session/kernels_after.sh > "$S/out/kernels_after.log" 2>&1 < /dev/null &
exec bash scripts/device_session/poll.sh "${1:-540}"
