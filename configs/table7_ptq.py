r"""Table 7 analog: post-training FP4 quantization of the BF16-trained policy vs TRACE.

The policies come from the Table 1 runs (`configs/table1_nvfp4.py`), one per seed:
python -m experiments.ptq_table --config=configs/table7_ptq.py \
    --bf16_policy=workdir/table1/bf16/seed0,workdir/table1/bf16/seed1,workdir/table1/bf16/seed2 \
    --trace_policy=workdir/table1/trace/seed0,workdir/table1/trace/seed1,workdir/table1/trace/seed2
"""

import ml_collections

from configs import small_gpu


def get_config() -> ml_collections.ConfigDict:
    return small_gpu.get_config()
