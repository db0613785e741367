r"""Peak host memory of loading a Hugging Face checkpoint (experiments/hf_load_memory.py).

python -m experiments.hf_load_memory                                    # ~3.9 GB checkpoint
python -m experiments.hf_load_memory --config.n_layers=4                # ~5.1 GB
python -m experiments.hf_load_memory --config=configs/hf_load_memory.py:smoke

A random bf16 checkpoint of Qwen3-30B-A3B's shapes (D=2048, 32/4 heads of 128, 128 experts of
768), cut to `n_layers` blocks and a `vocab_size`-row embedding and head, loaded by each way of
`loads` in a fresh process over `devices` host devices. Peak memory: the full load's is about
twice the checkpoint, so keep the checkpoint below a third of the machine's free memory.
`smoke`: the 2-block `tiny` model, a checkpoint of a few hundred KB (every stage, seconds).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Multi-GB sizes; `arg="smoke"`: the tiny model."""
    c = ml_collections.ConfigDict()
    c.smoke = False
    c.preset = "qwen3_5_35b_a3b"  # ModelConfig.<preset>: the layer shapes
    c.n_layers = 3  # decoder blocks written (the real model has 48)
    # Cut from 151936: on host devices the embedding and head are held once per device.
    c.vocab_size = 16384
    c.n_shards = 4  # safetensors files
    c.devices = 8  # host devices of the loading processes
    c.mesh = (1, 8)  # (data, expert) mesh of the sharded load: experts split 8 ways
    c.loads = ("full", "lazy", "sharded")
    c.workdir = ""  # where the checkpoint is written; "" = a temporary directory, removed after
    c.seed = 0
    if arg == "smoke":
        c.smoke = True
        c.preset = "tiny"
        c.n_layers = 2
        c.vocab_size = 64
        c.n_shards = 2
        c.mesh = (2, 4)
    elif arg:
        raise ValueError(f"unknown config variant {arg!r}; the only one is 'smoke'")
    return c
