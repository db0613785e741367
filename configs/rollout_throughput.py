r"""Whole rollouts at the paper's model shapes: tokens/s, prefill and the decode step against its
byte limit, bf16 vs FP4 vs FP4 + guidance capture (experiments/rollout_throughput.py).

A row compiles one rollout per variant (on an H200 about 18 s for bf16 and 50 s per FP4 variant at
12 blocks), then runs 1 + repeats whole rollouts and `repeats` prefills of each; a command also
spends about a minute starting, measuring the bandwidth and making the model. Each row prints its
rough time first (`estimate`). On an H200 (10-minute commands) run one row per command, merged
into one result (each command below takes 4-7 minutes by the estimates); a first check of a row
compiles only (about 4 minutes; no rollout runs, nothing is written):

python -m experiments.rollout_throughput --config.rows="((64, 1024, 256),)" \
    --config.compile_only=True
for row in "64, 1024, 256" "16, 1024, 1024"; do
  python -m experiments.rollout_throughput --config.rows="(($row),)" --config.merge=True
done
# batch 256 and 8K prompts: three commands per row (8K: one round); the merge keeps the last
# command's fp4, so that the compact capture's overhead pairs with fp4 of the same command
for variants in "'bf16', 'fp4'" "'fp4', 'fp4 + full'" "'fp4', 'fp4 + compact'"; do
  python -m experiments.rollout_throughput --config.rows="((256, 1024, 256),)" \
      --config.variants="($variants)" --config.merge=True
  python -m experiments.rollout_throughput --config.rows="((64, 8192, 256),)" \
      --config.variants="($variants)" --config.merge=True --config.repeats=1
done
python -m experiments.rollout_throughput --config.variants="('bf16', 'fp4')" \
    --config.model.grouped_matmul=tiled   # strings with spaces: quoted, in a tuple
# the prefill chunks' attention by the flash kernel beside XLA's, 8K prompts (one round)
python -m experiments.rollout_throughput --config.rows="((64, 8192, 256),)" --config.repeats=1 \
    --config.variants="('bf16', 'bf16 + flash prefill', 'fp4', 'fp4 + flash prefill')"
# the plain init's collapsed routing beside the default's near-uniform one (docs/kernels.md)
python -m experiments.rollout_throughput --config.rows="((64, 1024, 16),)" --config.repeats=1 \
    --config.variants="('bf16', 'fp4')" --config.model_init=normal
python -m experiments.rollout_throughput --config=configs/rollout_throughput.py:smoke  # CPU smoke
python -m experiments.rollout_throughput --plot_from=experiments/results/rollout_throughput.json

With JAX_COMPILATION_CACHE_DIR set, a later command on the same machine reuses compiled rollouts
(a row after its compile-only check, the fp4 variant of a row's next command).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Qwen3-30B-A3B shapes cut to 12 blocks; `arg="smoke"`: the 1-block `tiny` model, 2 rows of
    3 new tokens, one round."""
    c = ml_collections.ConfigDict()
    c.smoke = False
    # ModelConfig.<preset> with bf16 parameters (random init on the device), n_layers / head_dim
    # replaced where set; grouped_matmul: the bf16 rollout's routed experts
    # (trace_jax.models.grouped_matmul.GroupedMatmul)
    c.model = ml_collections.ConfigDict(
        {
            "preset": "qwen3_5_35b_a3b",
            "n_layers": 12,
            "head_dim": ml_collections.config_dict.placeholder(int),
            "grouped_matmul": "auto",
        }
    )
    # How the random model is initialized (trace_jax.rollout.variants.MODEL_INITS):
    # "selective_attention" (q/k norm scales 4) spreads a random prompt's tokens over all experts
    # as a load-balanced trained router does (busiest expert 1.5-3x the mean; uniform 1.3x);
    # "normal" (the plain init, results before this option) sends nearly every token to the
    # same top-k experts
    c.model_init = "selective_attention"
    c.format = "nvfp4"  # FP4 recipe of the FP4 variants (TRACE's rollout)
    c.variants = ("bf16", "fp4", "fp4 + compact", "fp4 + full")  # "fp4 xla" is selectable
    # (batch, prompt tokens, new tokens) per row; every variant runs every row
    c.rows = ((64, 1024, 256), (64, 8192, 256), (16, 1024, 1024), (256, 1024, 256))
    c.repeats = 2  # alternating timing rounds per row, after one warm-up rollout each
    # the sampler's prefill chunk (SamplingConfig.prefill_chunk_tokens); unset: its default
    c.prefill_chunk_tokens = ml_collections.config_dict.placeholder(int)
    c.ceiling_bytes = 1 << 30  # bytes of the read-bandwidth measurement
    c.summary_min_batch = 64  # the top-level worst cases are over rows of at least this batch
    c.merge = False  # merge into an existing <outdir>/<name>.json by (row, variant)
    c.compile_only = False  # compile every variant of every row from shapes; print, run nothing
    # The row time printed before each row (RolloutBench.estimate_s), on the slow side of the
    # first H200 run at these shapes: compile seconds of one rollout per decoder block, a decode
    # step's time over its byte limit (measured: 5.5 bf16, 8 FP4), prefill FLOP/s (under 5e13).
    c.estimate = ml_collections.ConfigDict(
        {"bf16_compile_s": 1.5, "fp4_compile_s": 4.5, "over_limit": 8.0, "prefill_flop_per_s": 4e13}
    )
    if arg == "smoke":
        c.smoke = True
        c.model.preset, c.model.n_layers, c.model.head_dim = "tiny", 1, 32
        c.rows, c.repeats, c.ceiling_bytes, c.summary_min_batch = (
            ((2, 8, 3), (4, 8, 3)),
            1,
            1 << 20,
            2,
        )
        c.prefill_chunk_tokens = 16
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
