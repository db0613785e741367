#!/bin/bash
# Starts the table job queue, the PTQ watcher and the kernel script detached; polls for $1 s.
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
[ -n "$LOCAL" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p "$JOBS/out" "$JOBS/repo"
# Detached jobs run from a copy: a later command's tree sync cannot touch them.
tar --exclude=./.venv --exclude=./.git --exclude=./workdir -cf - . | tar -xf - -C "$JOBS/repo"
cd "$JOBS/repo" || exit 1
nvidia-smi -L 2>/dev/null; date -u
# QUEUE_GPUS / AFTER_GPUS: the queue's GPUs and the kernel script's, to run both at once.
setsid env ${QUEUE_GPUS:+CUDA_VISIBLE_DEVICES=$QUEUE_GPUS} bash -c "echo \$\$ > $JOBS/queue.pid; exec $PY -m experiments.run_tables \
  --tables=$TABLES --root=$JOBS/tables --per_gpu=${PER_GPU:-5} --deadline_s=${DEADLINE:-1250} \
  --mem_fraction=${MEM_FRACTION:-0} --bundle=$JOBS/out/runs.tgz --done_from=\"$DONE_FROM\" --extra=\"$EXTRA\"" > "$JOBS/out/queue.log" 2>&1 < /dev/null &
sleep 2
if [[ $TABLES == *table7_ptq* ]]; then
  setsid bash scripts/detached_jobs/ptq_when_ready.sh > "$JOBS/out/ptq_watcher.log" 2>&1 < /dev/null &
else
  echo 0 > "$JOBS/ptq_rc"
fi
setsid bash scripts/detached_jobs/kernels_after.sh > "$JOBS/out/kernels_after.log" 2>&1 < /dev/null &
exec bash scripts/detached_jobs/poll.sh "${1:-540}"
