#!/bin/bash
# One section of `experiments.multi_gpu` (`parity`, `expert_parallel`, `disaggregated` or
# `weak_scaling`) as one command on a held machine of several GPUs; each section's jobs fit the
# machine's 10 minutes.
# Sections accumulate in $JOBS/multi_gpu (a later one merges into the JSON the earlier ones
# wrote) and a later command reuses the compiled programs in $JOBS/jax_cache while the machine
# stays held. Copies the table, the sections' logs and an archive of every job's log and
# metrics (`jobs.tgz`) to $OUT.
#   bash scripts/detached_jobs/multi_gpu_section.sh parity [limit seconds, default 570]
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
section=${1:?usage: multi_gpu_section.sh parity|expert_parallel|disaggregated|weak_scaling [limit seconds]}
limit=${2:-570}
if [ -z "$LOCAL" ] && [ ! -d /tmp/site/ml_collections ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
# The jobs run from this command's tree (they end with it), the compiled programs persist.
export PYTHONPATH=/tmp/site:$PWD JAX_COMPILATION_CACHE_DIR=$JOBS/jax_cache
mkdir -p "$JOBS/multi_gpu"
# A fresh machine merges its sections into the rows measured on earlier holds (the committed
# table), so that the table gathers sections measured on different holds of the same kind.
if [ -z "$LOCAL" ] && [ ! -f "$JOBS/multi_gpu/multi_gpu.json" ] &&
  [ -f experiments/results/multi_gpu.json ]; then
  cp experiments/results/multi_gpu.json "$JOBS/multi_gpu/"
fi
nvidia-smi -L 2>/dev/null; date -u
timeout "$limit" $PY -m experiments.multi_gpu $EXTRA --config.measure="$section" \
  --workdir="$JOBS/multi_gpu/work" --outdir="$JOBS/multi_gpu" > "$JOBS/multi_gpu/$section.log" 2>&1
rc=$?
date -u; echo "$section rc=$rc"
grep -v "^I1" "$JOBS/multi_gpu/$section.log" | tail -n 40
[ -n "$OUT" ] || exit $rc
cp "$JOBS"/multi_gpu/multi_gpu.{json,md} "$JOBS"/multi_gpu/*.log "$OUT"/ 2>/dev/null
# Every job's log and metrics in one archive (the machine returns a limited number of files).
(cd "$JOBS/multi_gpu/work" && find . \( -name '*.jsonl' -o -name '*.log' \) |
  tar czf "$OUT/jobs.tgz" -T -)
exit $rc
