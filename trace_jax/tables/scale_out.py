"""Scale-out measurements on the GPUs of one host, as jobs of the project's own entry points.

  procs = rl_job(Launch("configs/small_gpu.py", overrides), workdir, devices=[0, 1], processes=2)
  seconds = run_job(procs)                      # every process at once; a failure stops all
  rows = read_rows(f"{workdir}/rl_metrics.jsonl")

A job is a list of `Proc`s, each a subprocess of `experiments.main` (the GRPO loop) or
`experiments.disaggregated` (one role of the rollout / trainer pair) that sees only its own
devices: GPUs through `CUDA_VISIBLE_DEVICES`, or on a machine without GPUs that many host CPU
devices (`--xla_force_host_platform_device_count`), so the same jobs run as a CPU dry run. The
processes of one multi-process job meet through `jax.distributed` at a free local port
(`--coordinator`); on the CPU their collectives go through gloo (`trace_jax.distributed`).
NVLink multicast stays off in every child (`NO_MULTICAST`): on a shared host a program that uses
it can take the GPUs out of service.

What the jobs log is read back by `step_times` (`trace_jax.tables.step_time`), `step_parity`
(one step's metrics of two runs) and `disaggregated_summary` (the trainer's log of a pair).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

# The measurements of `experiments.multi_gpu`, in the order they are reported.
SECTIONS = ("parity", "expert_parallel", "disaggregated", "weak_scaling")
# Set in every child: NCCL, PyTorch and NVSHMEM never use NVLink multicast.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Metrics of a GRPO step that the sampled tokens and the settings decide (not float sums): two
# runs of one program on one mesh agree on them exactly.
EXACT_METRICS = ("reward", "response_length", "guidance_rtn_fallback_rows", "policy_version")


@dataclasses.dataclass(frozen=True)
class Launch:
    """What every process of a job runs: an experiment config (`configs/<name>.py[:variant]`)
    and `--config.<key>=<value>` overrides (e.g. "rl.method=trace")."""

    config: str
    overrides: tuple[str, ...] = ()

    def flags(self, **more) -> list[str]:
        """`--config=...` and the overrides, then `more` (key -> value, repr'd unless a str)."""
        extra = [f"{k}={v if isinstance(v, str) else repr(v)}" for k, v in more.items()]
        return [f"--config={self.config}", *(f"--config.{o}" for o in (*self.overrides, *extra))]


@dataclasses.dataclass(frozen=True)
class Proc:
    """One subprocess: `cmd`, the device indices it sees, the file its output goes to."""

    cmd: tuple[str, ...]
    devices: tuple[int, ...]
    log: str


def free_port() -> int:
    """A TCP port free on this host now (for `jax.distributed`'s coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rl_job(
    launch: Launch,
    workdir: str,
    devices: Sequence[int],
    processes: int,
    *,
    expert: int = 1,
    **settings,
) -> list[Proc]:
    """The GRPO loop (`experiments.main`) on `devices` as one mesh, driven by `processes`
    processes: 1 sees every device; n (= len(devices)) see one device each and join through
    `jax.distributed`. The mesh is data-parallel (`mesh.data = len(devices)`), or with
    `expert` > 1 splits the routed experts over `expert` devices (`mesh.expert = expert`,
    `mesh.data = len(devices) / expert`: each data shard's rows run on `expert` devices, each
    holding 1/expert of the experts; `trace_jax.rl.sharding`). `settings`: more config overrides
    (e.g. `rl.prompts_per_step=16`). Logs: `<workdir>/process_<k>.log`."""
    n = len(devices)
    if processes not in (1, n):
        raise ValueError(f"{processes} processes for {n} devices: one, or one per device")
    if expert < 1 or n % expert:
        raise ValueError(f"expert={expert} must be >= 1 and divide the {n} devices")
    mesh = {"mesh.data": n // expert, **({"mesh.expert": expert} if expert > 1 else {})}
    module = [sys.executable, "-m", "experiments.main", f"--workdir={workdir}"]
    cmd = [*module, *launch.flags(**mesh, **settings)]
    if processes == 1:
        return [Proc(tuple(cmd), tuple(devices), os.path.join(workdir, "process_0.log"))]
    join = [f"--coordinator=127.0.0.1:{free_port()}", f"--num_processes={n}"]
    return [
        Proc((*cmd, *join, f"--process_id={k}"), (d,), os.path.join(workdir, f"process_{k}.log"))
        for k, d in enumerate(devices)
    ]


def disaggregated_job(
    launch: Launch, workdir: str, rollout_device: int, trainer_device: int, **settings
) -> list[Proc]:
    """The rollout / trainer pair (`experiments.disaggregated`), each role on its own device,
    sharing only the exchange (`disaggregated.exchange`; "" = `<workdir>/exchange`). Each
    role's workdir is `<workdir>/<role>`."""
    settings.setdefault("disaggregated.exchange", os.path.join(workdir, "exchange"))
    procs = []
    for role, device in (("rollout", rollout_device), ("trainer", trainer_device)):
        own = os.path.join(workdir, role)
        cmd = [sys.executable, "-m", "experiments.disaggregated", f"--workdir={own}"]
        cmd += [*launch.flags(**settings), f"--role={role}"]
        procs.append(Proc(tuple(cmd), (device,), os.path.join(workdir, f"{role}.log")))
    return procs


def proc_env(proc: Proc, *, cpu: bool) -> dict[str, str]:
    """The child's environment: this one's, its devices only, GPU memory on demand, no NVLink
    multicast; on the CPU, as many host devices as the process has."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **NO_MULTICAST}
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={len(proc.devices)}"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, proc.devices))
    return env


class JobFailedError(RuntimeError):
    """A process of a job failed or ran past its time; the message holds each failed log's end."""


def run_job(procs: Sequence[Proc], *, cpu: bool = False, timeout_s: float = 560.0) -> float:
    """Starts every process of the job at once and waits for all; returns the wall seconds.
    When one fails, or the job runs past `timeout_s`, the others are stopped and
    `JobFailedError` names each failed process with the end of its log."""
    t0 = time.perf_counter()
    running = []
    for p in procs:
        os.makedirs(os.path.dirname(p.log) or ".", exist_ok=True)
        with open(p.log, "w") as out:
            running.append(
                subprocess.Popen(
                    p.cmd, stdout=out, stderr=subprocess.STDOUT, env=proc_env(p, cpu=cpu)
                )
            )
    failed = []
    try:
        while any(r.poll() is None for r in running):
            failed = [k for k, r in enumerate(running) if r.poll() not in (None, 0)]
            if failed or time.perf_counter() - t0 > timeout_s:
                break
            time.sleep(0.2)
    finally:
        for r in running:
            if r.poll() is None:
                r.terminate()
        for r in running:
            try:
                r.wait(timeout=10)
            except subprocess.TimeoutExpired:
                r.kill()
                r.wait()
    seconds = time.perf_counter() - t0
    failed = [k for k, r in enumerate(running) if r.returncode != 0]
    if failed:
        tails = []
        for k in failed:
            with open(procs[k].log, errors="replace") as f:
                tail = f.read()[-2000:]
            tails.append(f"{procs[k].log} (exit {running[k].returncode}):\n{tail}")
        raise JobFailedError(f"after {seconds:.0f} s:\n\n" + "\n\n".join(tails))
    return seconds


def step_parity(a: dict, b: dict, exact: Sequence[str] = EXACT_METRICS) -> dict:
    """How one step's metric rows of two runs agree: `exact_equal` (every `exact` key both log
    is equal), `max_rel_diff` over the other numeric keys both log (|a - b| / max(|a|, |b|),
    0 where both are 0), `worst` (that key) and `compared` (how many keys)."""
    shared = [k for k in a if k in b and k != "step" and not k.startswith("time_")]
    numeric = [k for k in shared if isinstance(a[k], int | float) and isinstance(b[k], int | float)]
    equal = all(a[k] == b[k] for k in exact if k in a and k in b)
    rel = {}
    for k in numeric:
        if k in exact:
            continue
        scale = max(abs(a[k]), abs(b[k]))
        rel[k] = 0.0 if scale == 0 else abs(a[k] - b[k]) / scale
    worst = max(rel, key=rel.get) if rel else ""
    return {
        "exact_equal": equal,
        "max_rel_diff": rel.get(worst, 0.0),
        "worst": worst,
        "compared": len(numeric),
    }


def disaggregated_summary(trainer_rows: Sequence[dict], skip: int, rows_per_step: int) -> dict:
    """The pair's throughput and staleness from the trainer's log (`rl_metrics.jsonl`) over the
    steps after the first `skip`: median seconds per step (`time_step_s`: waiting for the batch,
    training, publishing the policy), `steps_per_s` and `samples_per_s` (`rows_per_step` rows a
    step) from it, the median wait for the rollout batch, and the staleness used (policy versions
    between the batch's sampler and the last mini-batch's trainer): mean and max."""
    steady = [r for r in trainer_rows if r["step"] >= skip]
    if not steady:
        raise ValueError(f"no trainer steps after the first {skip} (got {len(trainer_rows)})")
    step = float(np.median([r["time_step_s"] for r in steady]))
    stale = [r["max_staleness_used"] for r in steady]
    return {
        "steps_timed": len(steady),
        "time_step_s": step,
        "steps_per_s": 1.0 / step,
        "samples_per_s": rows_per_step / step,
        "time_wait_rollout_s": float(np.median([r["time_wait_rollout_s"] for r in steady])),
        "staleness_mean": float(np.mean(stale)),
        "staleness_max": int(max(stale)),
        "reward": float(np.mean([r["reward"] for r in steady])),
    }
