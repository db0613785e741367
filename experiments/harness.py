"""Helpers shared by the entry points in `experiments/`: flags, result artifacts, benchmark
timing, and GPU worker subprocesses.

Flags: `define_config_flag` (`--config`: a file that does not load stops the program at once),
`define_fresh_flag` (`--fresh`), `define_result_flags` (`--outdir`, `--name`),
`define_distributed_flags` (`--coordinator`, `--num_processes`, `--process_id`: one process of a
multi-process run, joined by `join_from_flags` before any JAX backend use); `run_app` is the
whole absl main of an entry point that writes one result; `refusals_exit` turns the library's
refusals of settings into a one-line error.

Results: `write_results` writes `<name>.json` (rows + provenance: command, device, date) and
`<name>.md` (a markdown table) into `experiments/results/` or another directory; `write_table`
does so with the rows' own table, the usual end of an entry point's `run`.

Timing: `experiments.timing` (median seconds per call, interleaved rounds, device loops).

Kernel benchmarks: `ceilings` measures the device's read and copy bandwidth (what a kernel's
bytes per second are compared against); `random_kv` and `packed_kv_cache` build the K/V inputs of
the decode-attention benchmarks. A benchmark's `model` section is a `trace_jax.rl.ModelSpec`.

Workers: `run_workers` runs one subprocess per item of a script's work, each pinned to a GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from experiments.timing import time_fn
from kernels_pallas import common as kernel_common
from trace_jax import fp4
from trace_jax.distributed import DistributedConfig, initialize
from trace_jax.fp4 import PackedTensorCache
from trace_jax.rl.config_dict import ConfigError
from trace_jax.rl.logs import quiet_third_party
from trace_jax.rl.workdir import WorkdirConfigError
from trace_jax.rollout.variants import tree_nbytes

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class _ConfigFileParser(flags.ArgumentParser):
    """ml_collections' config file parser (`loader`), failing at once in one line: a missing file
    (which ml_collections reports only when the config is first read, a traceback later) or one
    whose import or `get_config` raises. absl prints the error and exits before `main` runs, so
    no entry point starts any work or creates any directory with a config it could not load."""

    def __init__(self, loader: flags.ArgumentParser):
        self.loader = loader

    def flag_type(self) -> str:
        return self.loader.flag_type()

    def parse(self, path):
        file = path.split(":", 1)[0]
        if not os.path.isfile(file):
            raise ValueError(f"no config file {file!r} (from {os.getcwd()})")
        try:
            config = self.loader.parse(path)
        except Exception as e:
            # ml_collections puts the whole traceback in the message: keep its last line.
            last = [line for line in str(e).splitlines() if line.strip()][-1:] or [repr(e)]
            cause = last[0] if isinstance(e, ValueError | TypeError) else f"{type(e).__name__}: {e}"
            raise ValueError(f"config file {file!r} failed to load: {cause}") from None
        if not isinstance(config, ml_collections.ConfigDict):
            raise ValueError(f"config file {file!r}: get_config() returned {type(config).__name__}")
        return config


def define_config_flag(default: str | None = None, flag_values=flags.FLAGS) -> None:
    """Defines `--config`: an ml_collections config file, locked (overrides like
    `--config.rl.steps=5` may only set fields the file defines). `default` names a file of
    `configs/` (without `.py`) used when `--config` is not given; None makes the flag required.
    A file that is missing or fails to load stops the program at flag parsing with a one-line
    error (`FATAL Flags parsing error: ...`), before `main` runs.
    """
    path = None if default is None else os.path.join(CONFIGS_DIR, f"{default}.py")
    config_flags.DEFINE_config_file(
        "config", path, "ml_collections config file", flag_values=flag_values, lock_config=True
    )
    flag = flag_values["config"]
    flag.parser = _ConfigFileParser(flag.parser)
    if default is None:
        flags.mark_flags_as_required(["config"], flag_values=flag_values)


def define_fresh_flag() -> None:
    """Defines `--fresh`: move an existing workdir aside (`trace_jax.rl.workdir.move_aside`) and
    start over, instead of resuming or reusing what it holds."""
    flags.DEFINE_bool(
        "fresh",
        False,
        "move an existing --workdir aside to <workdir>.old-<n> and start over (a workdir made "
        "with other settings is refused otherwise)",
    )


@contextlib.contextmanager
def refusals_exit():
    """Ends the program with a one-line error (exit status 1) when the library refuses the
    settings: a bad setting (`ConfigError`) or a workdir made with other settings
    (`WorkdirConfigError`). Their messages name what to change; a traceback adds nothing."""
    try:
        yield
    except (ConfigError, WorkdirConfigError) as e:
        raise SystemExit(f"error: {e}") from None


def define_workdir_flags(config: str, workdir: str, workdir_help: str) -> None:
    """The flags of an entry point that runs in a workdir: `--config` (default `config`),
    `--fresh`, `--workdir` (default `workdir`) and `--verbose`."""
    define_config_flag(config)
    define_fresh_flag()
    flags.DEFINE_string("workdir", workdir, workdir_help)
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl, jax)")


def workdir_main(run: Callable[..., Any]) -> Callable[[Sequence[str]], None]:
    """The absl `main` of an entry point `run(config, workdir, *, fresh)` with the flags of
    `define_workdir_flags`: third-party logging quiet unless `--verbose`, refusals as one line;
    the process joins its multi-process run first when the entry point defines
    `define_distributed_flags`."""

    def main(argv: Sequence[str]) -> None:
        del argv
        f = flags.FLAGS
        quiet_third_party(f.verbose)
        if "coordinator" in f:  # the entry point defines the distributed flags
            join_from_flags()
        with refusals_exit():
            run(f.config, f.workdir, fresh=f.fresh)

    return main


DISTRIBUTED_FLAGS = ("coordinator", "num_processes", "process_id")


def define_distributed_flags(flag_values=flags.FLAGS) -> None:
    """Defines `--coordinator`, `--num_processes` and `--process_id`: how this process joins a
    multi-process run (`trace_jax.distributed.DistributedConfig`; none set: one process).
    Inconsistent values stop the program at flag parsing with a one-line error.

    Flags rather than config fields: where the processes meet is a property of the launch,
    not of the run (a resumed run may start elsewhere), and the workdir records the config."""
    flags.DEFINE_string(
        "coordinator",
        "",
        "process 0's host:port, the same on every process ('auto': JAX detects the cluster: "
        "Cloud TPU pods, SLURM, Open MPI); empty: one process",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "num_processes", None, "processes of the run (with --coordinator)", flag_values=flag_values
    )
    flags.DEFINE_integer(
        "process_id", None, "this process's rank in [0, num_processes)", flag_values=flag_values
    )

    def check(values: dict) -> bool:
        try:
            DistributedConfig(**values)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True

    flags.register_multi_flags_validator(DISTRIBUTED_FLAGS, check, flag_values=flag_values)


def distributed_from_flags(flag_values=flags.FLAGS) -> DistributedConfig:
    """The `DistributedConfig` of the flags `define_distributed_flags` defines."""
    return DistributedConfig(**{name: flag_values[name].value for name in DISTRIBUTED_FLAGS})


def join_from_flags(flag_values=flags.FLAGS) -> DistributedConfig:
    """Joins the multi-process run the distributed flags describe (nothing for one process);
    call it before anything uses a JAX backend. Returns the config joined."""
    config = distributed_from_flags(flag_values)
    initialize(config)
    return config


def define_result_flags(name: str) -> None:
    """Defines `--outdir` (default `RESULTS_DIR`) and `--name` (default `name`): an entry point
    writes `<outdir>/<name>.{json,md}`."""
    flags.DEFINE_string("outdir", RESULTS_DIR, "where results are written")
    flags.DEFINE_string("name", name, "result file stem")


def run_app(run: Callable[..., Any], *, config: str, name: str) -> None:
    """The absl main of an entry point that writes one result: `--config` (default
    `configs/<config>.py`), `--outdir` and `--name` (default `name`), then
    `run(config, outdir=..., name=...)`."""
    define_config_flag(config)
    define_result_flags(name)

    def main(argv):
        del argv
        config = flags.FLAGS.config
        with smoke_interpretation(config):
            run(config, outdir=flags.FLAGS.outdir, name=flags.FLAGS.name)

    app.run(main)


def smoke_interpretation(config: ml_collections.ConfigDict) -> contextlib.AbstractContextManager:
    """Pallas interpretation for a smoke run (`config.smoke`) on a machine where Pallas does not
    compile (no GPU or TPU): a smoke run checks the plumbing, so its kernels are interpreted, as
    asked for here (elsewhere an explicit Pallas kernel raises). A no-op otherwise."""
    if config.get("smoke", False) and kernel_common.native_lowering() is None:
        logging.info("smoke run without a GPU or TPU: Pallas kernels interpreted")
        return kernel_common.interpreting(True)
    return contextlib.nullcontext()


GPU_STATE_QUERY = ("clocks.sm", "clocks.max.sm", "clocks.mem", "temperature.gpu", "power.draw")


def gpu_state() -> dict[str, str] | None:
    """The first GPU's SM / memory clocks, temperature and power as `nvidia-smi` reports them
    now, or None without one. Written beside timings because a hot GPU's lower SM clock slows
    instruction-bound kernels while bandwidth-bound ones keep their speed."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--id=0", f"--query-gpu={','.join(GPU_STATE_QUERY)}",
             "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in out.strip().splitlines()[0].split(",")] if out.strip() else []
    return dict(zip(GPU_STATE_QUERY, values, strict=True)) if len(values) == 5 else None


def provenance() -> dict[str, Any]:
    """Date, device and the exact command that produced a result; on a GPU, its clocks,
    temperature and power when the result was written (`gpu_state`)."""
    dev = jax.devices()[0]
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{dev.platform}: {getattr(dev, 'device_kind', str(dev))} x{jax.device_count()}",
        "command": "python -m " + " ".join([_module_name(), *sys.argv[1:]]),
        "jax": jax.__version__,
        "host": platform.machine(),
    }
    if dev.platform == "gpu" and (state := gpu_state()) is not None:
        meta["gpu_state_at_write"] = state
    return meta


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else os.path.basename(sys.argv[0])


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], fmt: str = ".4g") -> str:
    """A markdown table of `columns` from `rows`; floats formatted with `fmt`, cells a row does
    not have shown as "n/a"."""

    def cell(v: Any) -> str:
        return format(v, fmt) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "n/a")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(
    name: str,
    rows: list[dict[str, Any]],
    *,
    title: str,
    table: str,
    notes: str = "",
    outdir: str = RESULTS_DIR,
    extra: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Writes `<outdir>/<name>.json` and `.md`; returns their paths."""
    os.makedirs(outdir, exist_ok=True)
    meta = provenance()
    payload = {"meta": meta, "rows": rows, **(extra or {})}
    json_path = os.path.join(outdir, f"{name}.json")
    md_path = os.path.join(outdir, f"{name}.md")
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=1)
    header = (
        f"# {title}\n\n"
        f"- Regenerate: `{meta['command']}`\n"
        f"- Date: {meta['date']}; device: {meta['device']}; jax {meta['jax']}\n"
    )
    if state := meta.get("gpu_state_at_write"):
        header += "- GPU when written: " + ", ".join(f"{k} {v}" for k, v in state.items()) + "\n"
    header += "\n"
    with open(md_path, "w") as f:
        f.write(header + table + "\n" + (f"\n{notes}\n" if notes else ""))
    return {"json": json_path, "md": md_path}


def write_table(
    name: str,
    rows: list[dict[str, Any]],
    columns: Sequence[str],
    *,
    title: str,
    notes: str = "",
    fmt: str = ".4g",
    outdir: str = RESULTS_DIR,
    extra: dict[str, Any] | None = None,
) -> str:
    """`write_results` with the markdown table of `rows`' `columns` (`markdown_table`, floats
    formatted with `fmt`) as the table; returns that table, for the caller to print."""
    table = markdown_table(rows, columns, fmt)
    write_results(name, rows, title=title, table=table, notes=notes, outdir=outdir, extra=extra)
    return table


def rows_written_by(path: str, producer: str, required: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a result JSON written by `producer` (a module name, for the error), checked
    to carry the `required` keys in every row; a clear ValueError otherwise."""
    with open(path) as f:
        rows = json.load(f).get("rows")
    missing = sorted({k for r in rows or [{}] for k in required if k not in r})
    if not rows or missing:
        raise ValueError(f"{path} is not a result written by {producer} (rows lack {missing})")
    return rows


def nbytes(*trees) -> int:
    """Total bytes of all array leaves (`trace_jax.rollout.variants.tree_nbytes`)."""
    return tree_nbytes(*trees)


# Appended to the notes of a smoke run's results.
SMOKE_NOTE = " SMOKE RUN: tiny sizes, one timed call each; the numbers mean nothing."


def ceilings(n_bytes: int = 1 << 30, *, smoke: bool = False) -> dict[str, float]:
    """The device's bandwidth ceilings in bytes per second, measured on `n_bytes` of random data.

    `read_bw`: the faster of two reductions over the same uint8 bytes (summed as bytes, and as
    uint32 words: the byte sum alone was beaten by the bf16 decode-attention kernel on the H200,
    so it is no ceiling); `copy_bw`: bytes read plus written by an elementwise add over bf16.
    """
    u8 = jax.random.randint(jax.random.key(0), (n_bytes,), 0, 255, jnp.int32).astype(jnp.uint8)
    words = u8.reshape(-1, 4)
    t_read = min(
        time_fn(lambda a: jnp.sum(a, dtype=jnp.int32), u8, smoke=smoke),
        time_fn(lambda a: jnp.sum(jax.lax.bitcast_convert_type(a, jnp.uint32)), words, smoke=smoke),
    )
    x = jax.random.normal(jax.random.key(1), (n_bytes // 2,), jnp.bfloat16)
    t_copy = time_fn(lambda a: a + jnp.asarray(1, a.dtype), x, smoke=smoke)
    return {"read_bw": n_bytes / t_read, "copy_bw": 2 * nbytes(x) / t_copy}


def random_kv(
    batch: int, length: int, kv_heads: int, head_dim: int, seed: int
) -> tuple[jax.Array, jax.Array]:
    """Standard-normal K and V, bf16 [batch, length, kv_heads, head_dim] each (keys `seed` and
    `seed + 1`)."""
    shape = (batch, length, kv_heads, head_dim)
    k = jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(seed + 1), shape, jnp.bfloat16)
    return k, v


def packed_kv_cache(x: jax.Array, fmt: fp4.BlockFormat) -> PackedTensorCache:
    """The packed FP4 cache of `x [B, S, Hkv, Dh]` with all S slots written: RTN codes, one
    global scale per row for NVFP4, as the rollout's cache holds them."""
    b, s = x.shape[:2]
    slots = jnp.broadcast_to(jnp.arange(s), (b, s))
    return PackedTensorCache.empty(x.shape, fmt).write(fp4.quantize(x, fmt), slots)


def worker_command(module: str, worker_flag: str, item, argv: Sequence[str]) -> list[str]:
    """`python -m <module> --<worker_flag>=<item>` with `argv`'s flags, less `--gpus` and any
    earlier worker flag."""
    keep = [a for a in argv[1:] if not a.startswith(("--gpus", f"--{worker_flag}"))]
    return [sys.executable, "-m", module, f"--{worker_flag}={item}", *keep]


def run_workers(
    module: str, worker_flag: str, items: Sequence, gpus: Sequence, argv: Sequence[str] = ()
) -> list:
    """Runs one worker per item, item k on GPU `gpus[k % len(gpus)]`, all at once; waits for
    them and returns the items whose worker failed.

    Workers allocate GPU memory on demand (unless the caller's environment says otherwise): with
    JAX's default preallocation of 75% of the GPU a second worker on the same GPU, or a job
    already running there, fails out of memory."""
    if not gpus:
        raise ValueError("run_workers needs at least one GPU")
    argv = argv or sys.argv
    procs = []
    for k, item in enumerate(items):
        env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
        env["CUDA_VISIBLE_DEVICES"] = str(gpus[k % len(gpus)])
        procs.append(
            (item, subprocess.Popen(worker_command(module, worker_flag, item, argv), env=env))
        )
    return [item for item, p in procs if p.wait() != 0]
