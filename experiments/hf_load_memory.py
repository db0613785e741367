r"""Peak host memory of loading a Hugging Face checkpoint: read whole, lazily onto one device, and
sharded over a mesh of host devices.

Writes a random bf16 checkpoint (`trace_jax.models.hf_files.write_hf_checkpoint`, one shard in
memory at a time) and loads it in a fresh process per way (each process's peak resident memory,
`ru_maxrss`, is its own):
  full     every tensor read into host memory (`load_hf_tensors`), then placed on one device:
           what a loader without lazy slices does;
  lazy     `load_hf_checkpoint` onto one device: each parameter read slice by slice;
  sharded  `load_hf_checkpoint` with the RL steps' placement (`param_sharding_rule`) on a
           (data, expert) mesh: each device's block read on its own.
On host devices the device buffers are host memory too, so each row also gives the bytes of all
device buffers (a replicated parameter once per device) and what the peak holds beyond them and
beyond the process's memory before loading: on a GPU host only that excess stays on the host.
Sizes and launch commands: configs/hf_load_memory.py. Writes `<outdir>/<name>.{md,json}`
(default `hf_load_memory`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import ConfigDict

from experiments import harness
from trace_jax.models import ModelConfig, abstract_model
from trace_jax.models.hf_checkpoint import (
    hf_tensor_shapes,
    load_hf_checkpoint,
    model_from_hf_tensors,
    read_hf_config,
)
from trace_jax.models.hf_files import load_hf_tensors, write_hf_checkpoint
from trace_jax.rl.experiment import MODEL_PRESETS
from trace_jax.rl.sharding import make_mesh, param_sharding_rule

LOADS = ("full", "lazy", "sharded")
RESULT_LINE = "hf_load_memory result: "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_random_checkpoint(directory: str, cfg: ModelConfig, n_shards: int, seed: int) -> int:
    """A checkpoint of `cfg` with N(0, 0.02) bf16 weights in `n_shards` files of about equal
    size; returns the bytes of tensor data."""
    shapes = hf_tensor_shapes(cfg)
    sizes = {k: math.prod(s) * 2 for k, s in shapes.items()}
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(n_shards)]
    done = 0
    for key, size in sizes.items():
        groups[min(n_shards - 1, done * n_shards // total)].append(key)
        done += size

    def shards():
        rng = np.random.default_rng(seed)
        for group in groups:
            yield {
                k: (rng.standard_normal(shapes[k], np.float32) * 0.02).astype(ml_dtypes.bfloat16)
                for k in group
            }

    hf_config = {**cfg.to_hf_config(), "dtype": "bfloat16"}
    write_hf_checkpoint(directory, hf_config, shards(), n_shards=n_shards)
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far: `VmHWM` of /proc/self/status (Linux).
    `ru_maxrss` would not do: Linux keeps it across exec, so a child of a large parent starts at
    the parent's resident size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("/proc/self/status has no VmHWM line (this measurement is Linux-only)")


def machine() -> str:
    """CPU cores and memory of this machine (Linux)."""
    with open("/proc/meminfo") as f:
        total_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return f"{os.cpu_count()} CPU cores, {total_kb * 1024 / 1e9:.3g} GB memory"


def measure_load(load: str, checkpoint: str, mesh: tuple[int, int]) -> dict:
    """Loads `checkpoint` the way `load` names in this process: seconds, peak resident memory,
    the memory before loading and the bytes of the device buffers made."""
    jax.devices()  # the backend's own memory belongs to the memory before loading
    before = peak_rss_bytes()
    start = time.perf_counter()
    same_dtype = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)  # no conversion copies
    if load == "full":
        cfg = read_hf_config(checkpoint, **same_dtype)
        model = model_from_hf_tensors(cfg, load_hf_tensors(checkpoint))
    elif load == "lazy":
        model = load_hf_checkpoint(checkpoint, **same_dtype)
    elif load == "sharded":
        rule = param_sharding_rule(make_mesh(*mesh))
        model = load_hf_checkpoint(checkpoint, shardings=rule, **same_dtype)
    else:
        raise ValueError(f"load must be one of {LOADS}, got {load!r}")
    params = jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    seconds = time.perf_counter() - start
    device = sum(s.data.nbytes for p in params for s in p.addressable_shards)
    peak = peak_rss_bytes()
    return {
        "seconds": seconds,
        "device_GB": device / 1e9,
        "before_GB": before / 1e9,
        "peak_rss_GB": peak / 1e9,
        "beyond_device_GB": (peak - before - device) / 1e9,
    }


def load_in_fresh_process(load: str, checkpoint: str, devices: int, mesh) -> dict:
    """`measure_load` in a new Python process on `devices` host devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    kept = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])
    worker = json.dumps({"load": load, "checkpoint": checkpoint, "mesh": list(mesh)})
    cmd = [sys.executable, "-m", "experiments.hf_load_memory", f"--worker={worker}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = [s for s in done.stdout.splitlines() if s.startswith(RESULT_LINE)]
    if done.returncode or not lines:
        raise RuntimeError(f"{load} load failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_LINE))


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Writes the checkpoint, loads it each way of `config.loads` in its own process, writes
    `<outdir>/<name>.{md,json}`; returns the rows."""
    bad = [load for load in config.loads if load not in LOADS]
    if bad:
        raise ValueError(f"config.loads must name loads of {LOADS}, got {bad}")
    cfg = MODEL_PRESETS[config.preset](n_layers=config.n_layers, vocab_size=config.vocab_size)
    data, expert = config.mesh
    if data * expert > config.devices:
        raise ValueError(f"mesh {data} x {expert} needs more than {config.devices} devices")
    with contextlib.ExitStack() as stack:
        directory = config.workdir or stack.enter_context(tempfile.TemporaryDirectory())
        checkpoint_bytes = write_random_checkpoint(directory, cfg, config.n_shards, config.seed)
        rows = []
        for load in config.loads:
            row = {"load": load, "devices": 1 if load != "sharded" else data * expert}
            row["checkpoint_GB"] = checkpoint_bytes / 1e9
            row.update(load_in_fresh_process(load, directory, config.devices, config.mesh))
            rows.append(row)
            print(row, flush=True)
    largest = 2 * max(p.size for p in jax.tree.leaves(nnx.state(abstract_model(cfg))))
    notes = (
        f"A random bf16 checkpoint of `{config.preset}`'s layer shapes cut to {config.n_layers} "
        f"blocks and {config.vocab_size} vocabulary rows, in {config.n_shards} safetensors files; "
        f"each load in a fresh process on {config.devices} host CPU devices ({machine()}), "
        "parameters kept in "
        "bf16. `full`: every tensor read into host memory, then placed on one device; `lazy`: "
        "`load_hf_checkpoint` onto one device; `sharded`: `load_hf_checkpoint` with the RL "
        f"placement on a {data} x {expert} (data, expert) mesh (routed experts split along E, "
        "the rest replicated). `device_GB`: bytes of all device buffers, a replicated parameter "
        "once per device (on host devices they are host memory). `before_GB`: peak resident "
        "memory before loading (Python, JAX). `beyond_device_GB` = peak - before - device: "
        "host memory the load held beyond its arrays at the peak, what a GPU host would hold. "
        f"The largest parameter (one block's stacked expert projection) is {largest / 1e9:.3g} "
        "GB: `lazy` builds each parameter whole on the host before placing it, `sharded` only "
        "one device's block of it."
    )
    columns = ["load", "devices", "checkpoint_GB", "device_GB", "before_GB", "peak_rss_GB"]
    table = harness.write_table(
        name, rows, [*columns, "beyond_device_GB", "seconds"], title="Peak host memory of "
        "loading a Hugging Face checkpoint", notes=notes, fmt=".3g", outdir=outdir,
    )  # fmt: skip
    print(table)
    return rows


def main(argv):
    del argv
    if flags.FLAGS.worker:
        spec = json.loads(flags.FLAGS.worker)
        print(RESULT_LINE + json.dumps(measure_load(**spec)), flush=True)
        return
    run(flags.FLAGS.config, outdir=flags.FLAGS.outdir, name=flags.FLAGS.name)


if __name__ == "__main__":
    harness.define_config_flag("hf_load_memory")
    harness.define_result_flags("hf_load_memory")
    flags.DEFINE_string("worker", "", "(set by the run itself) one load, as JSON, in this process")
    app.run(main)
