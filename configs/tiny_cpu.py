r"""The `tiny` preset on the CPU: SFT warm start, then a short RL run (quickstart scale).

python -m experiments.quickstart --config=configs/tiny_cpu.py --workdir=workdir/quickstart
python -m experiments.sft --config=configs/tiny_cpu.py --workdir=/tmp/trace_tiny
python -m experiments.sft --config=configs/tiny_cpu.py --config.sft.steps=50
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    # grouped_matmul: "ragged_dot", "tiled" or "auto" (trace_jax/models/grouped_matmul.py);
    # n_layers: the preset's decoder-block count unless set (tests run 2-layer `tiny` models).
    c.model = ml_collections.ConfigDict(
        {
            "preset": "tiny",
            "init_std": 0.02,
            "grouped_matmul": "ragged_dot",
            "n_layers": ml_collections.config_dict.placeholder(int),
        }
    )
    # Devices: "data" splits each rollout batch, "expert" the routed experts (1 x 1: one device).
    c.mesh = ml_collections.ConfigDict({"data": 1, "expert": 1})
    c.tasks = ml_collections.ConfigDict(
        {"levels": (1,), "kinds": ("arithmetic", "countdown", "program")}
    )
    c.sft = ml_collections.ConfigDict(
        {
            "steps": 600,
            "batch_size": 32,
            "learning_rate": 3e-3,
            "warmup_steps": 20,
            "weight_decay": 0.01,
            "log_every": 50,
        }
    )
    c.eval = ml_collections.ConfigDict(
        {
            "splits": ("level1", "aime24", "aime25", "hmmt25", "livecodebench"),
            "problems_per_split": 48,
            "k": 1,
            "temperature": 0.0,
            "max_new_tokens": 64,
        }
    )
    c.rl = ml_collections.ConfigDict(
        {
            "method": "trace",  # bf16 | fp4_qat | qarl | quads | trace | trace_full
            "format": "nvfp4",  # nvfp4 | mxfp4_w4a4 | mxfp4_w4a8
            "guided_layers": "",  # "" = the method's own; all | half | quarter | eighth | "0,3"
            "init_from": "",  # an SFT checkpoint directory ("" = random init)
            "steps": 20,
            "prompts_per_step": 8,
            "group_size": 4,
            "max_new_tokens": 48,
            "temperature": 1.0,
            "learning_rate": 1e-4,
            "warmup_steps": 0,
            "mini_batches": 1,  # optimizer steps per batch; mini-batch m is m versions stale
            "max_staleness": 3,  # policy versions the trainer accepts between rollout and update
            "is_cap": 5.0,
            "routing_replay": True,
            "mismatch_every": 5,  # steps between per-site code-mismatch measurements (0: never)
            "eval_every": 10,
            "checkpoint_every": 10,
        }
    )
    return c
