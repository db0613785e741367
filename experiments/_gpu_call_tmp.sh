set -x
XLA_FLAGS="--xla_dump_to=$OUT/dump" timeout 90 python experiments/_dump_attn_tmp.py > $OUT/dump.log 2>&1
find $OUT/dump -type f ! -name "*.ptx" -delete
ls -la $OUT/dump | head
PTXAS=$(python -c "import nvidia.cuda_nvcc, os; print(os.path.join(list(nvidia.cuda_nvcc.__path__)[0], 'bin', 'ptxas'))" 2>/dev/null)
ls $PTXAS; which nvdisasm cuobjdump ptxas
NVD=$(find / -name nvdisasm -type f 2>/dev/null | head -1); echo NVD=$NVD
for f in $OUT/dump/*.ptx; do grep -q fp4_decode_attn $f && cp $f $OUT/attn.ptx; done
ls -la $OUT/attn.ptx && $PTXAS -arch=sm_90a -v $OUT/attn.ptx -o /tmp/attn.cubin > $OUT/ptxas.log 2>&1; tail -20 $OUT/ptxas.log
[ -n "$NVD" ] && $NVD -c /tmp/attn.cubin > $OUT/attn.sass 2>&1; rm -rf $OUT/dump
timeout 420 python -m experiments.bench_kernels --sections=decode_attention,moe --outdir=$OUT --name=kernels > $OUT/bench.log 2>&1; echo bench rc $?
timeout 80 python -m pytest -q -x tests/kernels_pallas/test_fp4_decode_attention.py tests/kernels_pallas/test_common.py -p no:cacheprovider > $OUT/tests.log 2>&1; echo tests rc $?; tail -3 $OUT/tests.log
