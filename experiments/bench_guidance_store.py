r"""Guidance store round trip at a GRPO step's size: write (async + flush) and read back per step.

The RL loop passes every mini-batch's guidance through the tensorstore store (rollout -> store ->
trainer). This times that round trip for the guidance a method captures on a model preset, with
random host data of the real shapes (site shapes: expert_in [B, T, D], expert_mid [B, T, K, F],
k / v [B, T, Hkv, Dh]), on a local-directory store, with and without an fsync per file
(`GuidanceStoreConfig.durable`). Medians over `steps` steps after one warm-up step. Sizes and
launch commands: configs/bench_guidance_store.py. Writes `<outdir>/<name>.{md,json}` (default
`guidance_store`).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np
from ml_collections import ConfigDict

from experiments import harness
from trace_jax.fp4 import Guidance, GuidanceMode
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig
from trace_jax.models import ModelConfig
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ModelSpec
from trace_jax.rl.methods import get_method


def site_shape(cfg: ModelConfig, name: str, rows: int, tokens: int) -> tuple[int, ...]:
    """The activation shape a site quantizes in the sampler (last axis: the quantized one)."""
    return {
        "expert_in": (rows, tokens, cfg.d_model),
        "expert_mid": (rows, tokens, cfg.top_k, cfg.d_ff_expert),
        "k": (rows, tokens, cfg.n_kv_heads, cfg.head_dim),
        "v": (rows, tokens, cfg.n_kv_heads, cfg.head_dim),
    }[name]


def random_guidance(cfg, method: str, fmt_name: str, rows: int, tokens: int, seed: int = 0):
    """Host guidance of the method's captured sites with random payload, scales and masks."""
    setup = get_method(method).setup(fmt_name, cfg.n_layers)
    rng = np.random.default_rng(seed)
    out = {}
    for key in setup.capture:
        name = key.split("/")[1]
        fmt = setup.rollout_qcfg.format_for(name)
        *lead, n = site_shape(cfg, name, rows, tokens)
        per_byte = 8 if setup.capture_mode is GuidanceMode.COMPACT else 2
        payload = rng.integers(0, 256, (*lead, n // per_byte), dtype=np.uint8)
        scales = rng.integers(40, 80, (*lead, n // fmt.block_size), dtype=np.uint8)
        glob = rng.random((*lead, 1), dtype=np.float32) if fmt.name == "nvfp4" else None
        mask = rng.random(lead) < 0.9
        out[key] = Guidance(
            payload, scales.view(np.dtype(fmt.scale_dtype)), glob, mask, fmt, setup.capture_mode
        )
    return out


def measure(guidance, *, mini_batches: int, steps: int, durable: bool) -> dict:
    """Seconds per step to write `mini_batches` entries (async + flush) and read them back."""
    nbytes = sum(
        x.nbytes
        for g in guidance.values()
        for x in (g.payload, g.scales, g.global_scale, g.mask)
        if x is not None
    )
    writes, reads = [], []
    with tempfile.TemporaryDirectory() as d:
        with GuidanceStore(GuidanceStoreConfig(kvstore=d, durable=durable)) as store:
            for step in range(steps + 1):
                t0 = time.perf_counter()
                for m in range(mini_batches):
                    store.write_async("r", step, guidance, policy_version=step, micro_batch=m)
                store.flush()
                t1 = time.perf_counter()
                for m in range(mini_batches):
                    store.read("r", step, micro_batch=m, expected_version=step)
                t2 = time.perf_counter()
                store.gc("r", step)
                if step:  # the first step warms up
                    writes.append(t1 - t0)
                    reads.append(t2 - t1)
    w, r = statistics.median(writes), statistics.median(reads)
    return {
        "durable": durable,
        "MB_per_step": mini_batches * nbytes / 1e6,
        "write_s": w,
        "read_s": r,
        "round_trip_s": w + r,
        "write_MBps": mini_batches * nbytes / 1e6 / w,
    }


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Times the round trip with and without fsync, writes `<outdir>/<name>.{md,json}`; returns
    the rows."""
    cfg = from_section(ModelSpec, config.model).build()
    method, fmt, rows, tokens = config.method, config.format, config.rows, config.tokens
    mini_batches, steps, preset = config.mini_batches, config.steps, config.model.preset
    guidance = random_guidance(cfg, method, fmt, rows // mini_batches, tokens)
    if not guidance:
        raise ValueError(f"method {method!r} captures no guidance")
    out = []
    for durable in (True, False):
        row = {"preset": preset, "method": method, "format": fmt, "rows": rows, "tokens": tokens}
        row.update(measure(guidance, mini_batches=mini_batches, steps=steps, durable=durable))
        out.append(row)
        print(row, flush=True)
    cols = ["preset", "method", "durable", "MB_per_step", "write_s", "read_s", "round_trip_s"]
    notes = (
        f"{rows} rollouts x {tokens} tokens per step in {mini_batches} mini-batch entries, the "
        f"guidance `{method}` captures on `{preset}` ({fmt}); random host data of the real shapes "
        f"on a local-directory store; median of {steps} steps after a warm-up. `durable`: an "
        "fsync per file before an entry counts as committed."
    )
    table = harness.write_table(
        name, out, [*cols, "write_MBps"], title="Guidance store round trip per GRPO step",
        notes=notes, fmt=".3g", outdir=outdir,
    )  # fmt: skip
    print(table)
    return out


if __name__ == "__main__":
    harness.run_app(run, config="bench_guidance_store", name="guidance_store")
