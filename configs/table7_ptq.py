r"""Table 7 analog: post-training FP4 quantization of the BF16-trained policy vs TRACE.

The policies are trained as this config's own table (Table 1's `bf16` and `trace` recipes, 3
seeds; checkpoints stay where they were trained, so train and evaluate on one machine):

  python -m experiments.run_tables --tables=configs/table7_ptq.py --root=$R
  P=$R/table7_policies
  python -m experiments.ptq_table --config=configs/table7_ptq.py --gpus=0,1 \
      --bf16_policy=$P/bf16/seed0,$P/bf16/seed1,$P/bf16/seed2 \
      --trace_policy=$P/trace/seed0,$P/trace/seed1,$P/trace/seed2
"""

import ml_collections

from configs import small_gpu
from trace_jax.rl.config_dict import section_config_dict
from trace_jax.tables.grid import table_section
from trace_jax.tables.ptq_table import PTQTableConfig


def get_config() -> ml_collections.ConfigDict:
    c = small_gpu.get_config()
    c.table = table_section(
        name="table7_policies",
        title="Table 7 policies: BF16 and TRACE GRPO runs to quantize / compare",
        seeds=(0, 1, 2),
        runs=(("bf16", {"rl.method": "bf16"}), ("trace", {"rl.method": "trace"})),
    )
    c.ptq = section_config_dict(PTQTableConfig)
    return c
