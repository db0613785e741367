#!/bin/bash
# One section of `experiments.multi_gpu` (`parity`, `disaggregated` or `weak_scaling`) as one
# command on a held machine of several GPUs; each section's jobs fit the machine's 10 minutes.
# Sections accumulate in $JOBS/multi_gpu (a later one merges into the JSON the earlier ones
# wrote) and a later command reuses the compiled programs in $JOBS/jax_cache while the machine
# stays held. Copies the table and every job's log (absl info lines filtered out) to $OUT.
#   bash scripts/detached_jobs/multi_gpu_section.sh parity [limit seconds, default 570]
D=$(cd "$(dirname "$0")" && pwd)
source "$D/common.sh"
section=${1:?usage: multi_gpu_section.sh parity|disaggregated|weak_scaling [limit seconds]}
limit=${2:-570}
if [ -z "$LOCAL" ] && [ ! -d /tmp/site/ml_collections ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
# The jobs run from this command's tree (they end with it), the compiled programs persist.
export PYTHONPATH=/tmp/site:$PWD JAX_COMPILATION_CACHE_DIR=$JOBS/jax_cache
mkdir -p "$JOBS/multi_gpu"
nvidia-smi -L 2>/dev/null; date -u
timeout "$limit" $PY -m experiments.multi_gpu $EXTRA --config.measure="$section" \
  --workdir="$JOBS/multi_gpu/work" --outdir="$JOBS/multi_gpu" > "$JOBS/multi_gpu/$section.log" 2>&1
rc=$?
date -u; echo "$section rc=$rc"
grep -v "^I1" "$JOBS/multi_gpu/$section.log" | tail -n 40
[ -n "$OUT" ] || exit $rc
cp "$JOBS"/multi_gpu/multi_gpu.{json,md} "$OUT"/ 2>/dev/null
mkdir -p "$OUT/logs"
for log in "$JOBS"/multi_gpu/*.log "$JOBS"/multi_gpu/work/*/*.log; do
  name=${log#"$JOBS"/multi_gpu/}
  [ -f "$log" ] && grep -v "^I1" "$log" | tail -c 200000 > "$OUT/logs/${name//\//_}"
done
(cd "$JOBS/multi_gpu/work" && find . -name rl_metrics.jsonl | tar czf "$OUT/metrics.tgz" -T -)
exit $rc
