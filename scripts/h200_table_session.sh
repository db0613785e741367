#!/usr/bin/env bash
# One GPU session of a paper table (device tool; run from the repo root, carrying .whl):
#
#   bash scripts/h200_table_session.sh CONFIG NAME [WORKERS] [DEADLINE_S]
#
#   CONFIG      a table config, e.g. configs/table1_nvfp4.py
#   NAME        its runs directory: experiments/results/runs/NAME (run logs of finished runs)
#   WORKERS     paper_table worker processes, spread over the visible GPUs (default 4; one
#               `small` run leaves an H200 mostly idle, so several share a GPU)
#   DEADLINE_S  no worker starts a new chunk after this many seconds (default 1200)
#   $EXTRA      more flags for every paper_table command (config overrides, --chunk_steps)
#
# Runs the SFT stage, then the workers (`--shard=i/WORKERS`); runs whose logs are already in
# experiments/results/runs/NAME are skipped. Checkpoints (hundreds of MB) cannot come back from
# the device, so a run unfinished at the deadline starts over in the next session, and every
# session re-runs the (seeded) SFT stage. What comes back: $OUT/runs.tgz with every run's
# rl_metrics / rl_eval logs, the SFT evaluation and the worker logs. Then, here:
#
#   tar xzf runs.tgz -C experiments/results/runs/NAME
#   python -m experiments.paper_table --config=CONFIG --workdir=experiments/results/runs/NAME \
#       --aggregate_only        # with the same config overrides as $EXTRA, if any
#
# Checked as a CPU dry run (tiny overrides in $EXTRA, 2 workers: SFT, 5 runs, logs, aggregate).
set -u
CONFIG=$1 NAME=$2 WORKERS=${3:-4} DEADLINE=${4:-1200}
W=/tmp/table_$NAME
mkdir -p "$W" && cp -r "experiments/results/runs/$NAME/." "$W/" 2>/dev/null
# Several processes per GPU: allocate on demand (JAX preallocates 75% of the GPU otherwise);
# workers of one method share compiled programs through the persistent cache.
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
export PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1  # no GPU: CPU dry run
mkdir -p "$W/logs"
echo "$(date -u) SFT stage"
python -m experiments.paper_table --config="$CONFIG" --workdir="$W" --sft_only ${EXTRA:-} \
  > "$W/logs/sft.log" 2>&1 || { tail -20 "$W/logs/sft.log"; exit 1; }
echo "$(date -u) $WORKERS workers on $NGPU GPU(s)"
for i in $(seq 0 $((WORKERS - 1))); do
  CUDA_VISIBLE_DEVICES=$((i % NGPU)) python -m experiments.paper_table --config="$CONFIG" \
    --workdir="$W" --shard="$i/$WORKERS" --deadline_s="$DEADLINE" ${EXTRA:-} \
    > "$W/logs/worker$i.log" 2>&1 &
done
wait
echo "$(date -u) workers done"
for f in "$W"/logs/*.log; do grep -v '^[IW][0-9]' "$f" | tr '\r' '\n' | grep -v '^$' > "$f.txt"; done
(cd "$W" && find . \( -name 'rl_*.jsonl' -o -name 'sft_eval.json' -o -name 'sft_metrics.jsonl' \
  -o -name '*.log.txt' \) -print0 | tar czf "$OUT/runs.tgz" --null -T -)
ls -la "$OUT"
