r"""What a read and a copy of N bytes reach on this device, by N (`harness.ceilings`).

Every byte-limit ratio in the results divides by the read ceiling measured on 1 GiB. A kernel of
a decode step reads far less: an FP4 expert matmul at the Qwen3-30B-A3B shapes reads about 100 MB,
and at that size XLA's own read (a reduction over random bytes) already takes longer per byte.
This table gives the ceiling at each size, so that a kernel's time can also be set against what a
plain read of its own bytes takes (`read_us`). Sizes: configs/bandwidth_ceilings.py. Writes
`<outdir>/<name>.{md,json}` (default `bandwidth_ceilings`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from experiments import harness, timing

COLUMNS = [
    "size_mb",
    "read_tb_s",
    "read_us",
    "loop_read_tb_s",
    "loop_read_us",
    "copy_tb_s",
    "read_vs_largest",
]
MB = 1 << 20
LOOP_BYTES = 8 << 30  # bytes a device loop reads in all: its launch overheads stay below 1%


def loop_read_seconds(n_bytes: int, *, smoke: bool = False) -> float:
    """Seconds per read of `n_bytes` random uint8 inside one jitted `fori_loop`, each pass a
    reduction of the bytes XORed with the pass index (a fresh read every pass, nothing hoisted):
    the host dispatches once per loop, so at small sizes this is the device's time, where
    `harness.ceilings` (one dispatch per read) meets the host's dispatch floor."""
    u8 = jax.random.randint(jax.random.key(0), (n_bytes,), 0, 255, jnp.int32).astype(jnp.uint8)
    reps = 2 if smoke else max(8, LOOP_BYTES // n_bytes)

    def reads(a):
        def body(i, acc):
            return acc + jnp.sum(a ^ i.astype(jnp.uint8), dtype=jnp.int32)

        return jax.lax.fori_loop(0, reps, body, jnp.int32(0))

    return timing.time_fn(reads, u8, inner=1, trials=5, smoke=smoke) / reps


def bench(config: ConfigDict) -> list[dict]:
    """One row per size: `read_tb_s` / `copy_tb_s` (TB/s, 1e12 bytes a second, one dispatch a
    call), `read_us` (the read's time), `loop_read_*` (the same read inside one device loop,
    `loop_read_seconds`), `read_vs_largest` (`read_tb_s` over the largest size's)."""
    sizes = sorted(config.sizes_mb)
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"sizes_mb must be positive sizes in MiB, got {tuple(config.sizes_mb)}")
    rows = []
    for size in sizes:
        n = int(size * MB) // 4 * 4  # whole uint32 words
        c = harness.ceilings(n, smoke=config.smoke)
        t_loop = loop_read_seconds(n, smoke=config.smoke)
        rows.append(
            {
                "size_mb": size,
                "read_tb_s": c["read_bw"] / 1e12,
                "read_us": n / c["read_bw"] * 1e6,
                "loop_read_tb_s": n / t_loop / 1e12,
                "loop_read_us": t_loop * 1e6,
                "copy_tb_s": c["copy_bw"] / 1e12,
            }
        )
    for r in rows:
        r["read_vs_largest"] = r["read_tb_s"] / rows[-1]["read_tb_s"]
    return rows


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Measures every size and writes `<outdir>/<name>.{md,json}`; returns the rows."""
    rows = bench(config)
    table = harness.write_table(
        name,
        rows,
        COLUMNS,
        title="Read and copy bandwidth by size",
        notes=(
            "`read_tb_s`: the faster of two XLA reductions over the same random bytes (as "
            "bytes and as uint32 words), one dispatch a call; `copy_tb_s`: bytes read plus "
            "written by an elementwise add over bf16; `read_us`: the read's time at that size; "
            "`loop_read_*`: the same bytes read again and again inside one jitted loop (one "
            "dispatch for 8 GiB of reads: the device's time, without the host's per-call "
            "dispatch floor); `read_vs_largest`: `read_tb_s` over the largest size's. MB here "
            "is MiB." + (harness.SMOKE_NOTE if config.smoke else "")
        ),
        outdir=outdir,
    )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="bandwidth_ceilings", name="bandwidth_ceilings")
