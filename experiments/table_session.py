r"""One GPU session of paper tables: their (run, seed) pairs as a queue of jobs on shared GPUs.

  python -m experiments.table_session \
      --tables=configs/table1_nvfp4.py,configs/table4_mxfp4.py --root=/tmp/tables \
      --per_gpu=3 --deadline_s=1200 --bundle=$OUT/runs.tgz --done_from=experiments/results/runs

1. The SFT warm start runs once, in `<root>/sft` (every table must share its SFT settings:
   checked), and is linked into each table's workdir `<root>/<table name>/sft`.
2. Every (table, run, seed) without a final evaluation is a job, in table order. `gpus x per_gpu`
   slots each run one job at a time: `experiments.paper_table --runs=<label> --shard=<k>/<seeds>`
   (exactly seed k of that run) pinned to its GPU with on-demand GPU memory. A failed job (an
   out-of-memory when co-tenants peak, say) is retried once, from its last checkpoint. No job
   starts after `--deadline_s`; what is unfinished then stays a job for the next session.
3. `<root>/session.jsonl` logs every job's start and end (time, GPU, return code); `--bundle`
   writes the run logs (no checkpoints or guidance stores), the SFT evaluation and the job logs to
   one tarball, as brought back from a device session. `--unpack=runs.tgz --tag=<date>` puts
   it into `experiments/results/runs/<table name>/` (the shared `sft/` beside each table's runs,
   job logs under `logs/`); then `paper_table --aggregate_only` (`--partial` while seeds are
   missing) writes each table from its logs.

A (table, run, seed) that trains exactly what an earlier one of the session trains
(`run_identity`: the same config once the method's guided layers are resolved, e.g. Table 7's
`trace` and Table 5's `trace half`) is trained once; its logs are copied into the other table's
run directory with a `same_run_as.txt` naming the source.

`--extra` passes more flags to every subprocess (config overrides; the tests use a tiny model).
One `small` run leaves an H200 mostly idle. With `grouped_matmul="ragged_dot"` (38 GiB train
step) three runs per GPU took 1.0-1.7 s per GRPO step each and five ran out of memory
(`results/runs/table1_nvfp4/README.md`); with "auto" (2026-11-30, `trace`, from random init) one
run alone takes 0.77 s per step, six per GPU 3.1-3.6 s each (1.8 steps/s in all), and nine ran
out of memory (141 GiB in use): N copies of `python -m experiments.rl_step_time
--config=configs/small_gpu.py --methods=trace --steps=14 --skip=4` started together on one GPU of
an nvidia-h200-x2 host (six on GPU 0, nine on GPU 1), with on-demand GPU memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import main as rl_main
from experiments import paper_table, sft
from trace_jax.rl.methods import get_method

# What a device session brings back: logs and evaluations, never checkpoints or guidance stores.
BUNDLE_SUFFIXES = (
    "rl_metrics.jsonl",
    "rl_eval.jsonl",
    "sft_eval.json",
    "sft_metrics.jsonl",
    "same_run_as.txt",
)
BUNDLE_DIRS_SKIPPED = ("rl_checkpoints", "guidance", "sft_checkpoint", "tensorboard", "jax_cache")


def job_env(root: str, gpu: int | None, mem_fraction: float = 0.0) -> dict[str, str]:
    """A job's environment: pinned to `gpu`, GPU memory on demand (several runs share a GPU),
    optionally capped at `mem_fraction` of it (0: no cap), compiled programs shared through a
    persistent cache (runs of one method compile alike)."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if mem_fraction:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.3f}"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.abspath(root), "jax_cache"))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


@dataclasses.dataclass(frozen=True)
class Job:
    """One (table, run, seed): `seed_index` is the seed's position in the table's seeds."""

    config_path: str
    table: str
    label: str
    seed: int
    seed_index: int
    n_seeds: int
    # The job whose run this one is (the same training in another table): copied, not trained.
    same_as: str = ""

    @property
    def name(self) -> str:
        return f"{self.table}/{self.label}/seed{self.seed}".replace(" ", "_")

    def run_dir(self, root: str) -> str:
        return paper_table.run_dir(os.path.join(root, self.table), self.label, self.seed)

    def command(self, root: str, extra: Sequence[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "experiments.paper_table",
            f"--config={self.config_path}",
            f"--workdir={os.path.join(root, self.table)}",
            f"--runs={self.label}",
            f"--shard={self.seed_index}/{self.n_seeds}",
            "--chunk_steps=1000000",  # one chunk: the run's own checkpoints make it resumable
            *extra,
        ]


def load_table(path: str, extra: Sequence[str]):
    """The table config at `path` with the `--config.*` overrides among `extra` applied."""
    argv = ["table_session", f"--config={path}", *[a for a in extra if a.startswith("--config.")]]
    fv = flags.FlagValues()
    # config_flags registers the override flags it finds in `sys_argv` when the flag is defined.
    holder = config_flags.DEFINE_config_file("config", path, flag_values=fv, sys_argv=argv)
    fv(argv)
    return holder.value


def check_shared_sft(cfgs: Sequence) -> None:
    """All tables must train the same SFT warm start (model, tasks, SFT settings)."""
    first = cfgs[0]
    for cfg in cfgs[1:]:
        for section in ("model", "tasks", "sft"):
            if cfg[section].to_dict() != first[section].to_dict():
                raise ValueError(
                    f"tables {first.table.name} and {cfg.table.name} differ in `{section}`: "
                    "they cannot share one SFT stage; run them in separate sessions"
                )


def pending_jobs(table_paths: Sequence[str], cfgs: Sequence, root: str) -> list[Job]:
    """Every (table, run, seed) of the tables without a final evaluation under `root`."""
    jobs = []
    for path, cfg in zip(table_paths, cfgs, strict=True):
        workdir = os.path.join(root, cfg.table.name)
        seeds = list(cfg.table.seeds)
        for label, _ in cfg.table.runs:
            done = paper_table.finished_seeds(cfg, workdir, label)
            for k, seed in enumerate(seeds):
                if seed not in done:
                    jobs.append(Job(path, cfg.table.name, label, seed, k, len(seeds)))
    return jobs


def run_identity(cfg, label: str, overrides: dict, seed: int) -> str:
    """What a table's (run, seed) trains, as a string: the experiment config without the table
    and with the guided layers resolved through the method (Table 7's `trace` is Table 5's `trace
    half`: TRACE guides the deeper half by default). Tables of one session share the SFT stage,
    so runs of equal identity are the same training."""
    c = paper_table.run_config(cfg, label, overrides, seed, sft_checkpoint="")
    n_layers = sft.model_config(c).n_layers
    quant = get_method(c.rl.method).quant_configs(
        c.rl.format, n_layers, guided_layers=rl_main.guided_layers(c.rl, n_layers)
    )
    d = c.to_dict()
    del d["table"], d["rl"]["guided_layers"]
    return json.dumps({"config": d, "quant": repr(quant)}, sort_keys=True, default=str)


def share_identical_runs(cfgs: Sequence, root: str, jobs: Sequence[Job]) -> list[Job]:
    """Marks each pending job that trains what an earlier (table, run, seed) of the session trains
    (`run_identity`) as the same as that one: its logs are copied once the first finishes
    (`copy_run`; at once if it finished in an earlier invocation). Returns the jobs left."""
    first: dict[str, tuple[str, str]] = {}  # identity -> (job name, run dir)
    pending = {j.name: j for j in jobs}
    out = []
    for cfg in cfgs:
        for label, overrides in cfg.table.runs:
            for k, seed in enumerate(cfg.table.seeds):
                job = Job("", cfg.table.name, label, seed, k, 0)
                name, here = job.name, job.run_dir(root)
                key = run_identity(cfg, label, overrides, seed)
                if key not in first:
                    first[key] = (name, here)
                    if name in pending:
                        out.append(pending[name])
                    continue
                if name not in pending:
                    continue
                src_name, src = first[key]
                if src_name in pending:
                    out.append(dataclasses.replace(pending[name], same_as=src_name))
                else:
                    copy_run(src, here)
    return out


def copy_run(src: str, dst: str) -> None:
    """The logs and evaluations of the run in `src` (not checkpoints or guidance) into `dst`, with
    a note naming where they came from."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith(BUNDLE_SUFFIXES):
            shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(dst, "same_run_as.txt"), "w") as f:
        f.write(os.path.relpath(src, os.path.dirname(os.path.dirname(os.path.dirname(dst)))) + "\n")


def adopt_finished(cfg, root: str, done_from: str) -> list[str]:
    """Copies the logs of runs finished in earlier sessions (`<done_from>/<table name>/<label>/
    seed<k>`, e.g. `experiments/results/runs`) into `<root>`, so their jobs are not run again;
    returns the run directories adopted."""
    name = cfg.table.name
    adopted = []
    for label, _ in cfg.table.runs:
        for seed in paper_table.finished_seeds(cfg, os.path.join(done_from, name), label):
            src = paper_table.run_dir(os.path.join(done_from, name), label, seed)
            dst = paper_table.run_dir(os.path.join(root, name), label, seed)
            if not os.path.exists(dst):
                shutil.copytree(src, dst)
                adopted.append(dst)
    return adopted


def link_sft(root: str, tables: Sequence[str]) -> None:
    """Points each table workdir's `sft` at the shared `<root>/sft`."""
    os.makedirs(os.path.join(root, "sft"), exist_ok=True)
    for name in tables:
        os.makedirs(os.path.join(root, name), exist_ok=True)
        link = os.path.join(root, name, "sft")
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "sft"), link)


Launch = Callable[[Job, int | None, str], subprocess.Popen]


def next_log_path(log_dir: str, job_name: str) -> str:
    """`<log_dir>/<job>.<n>.log` with n the number of that job's logs already there: attempts
    are numbered on across the invocations that share a root, so no log is overwritten."""
    stem = job_name.replace("/", "_")
    n = sum(1 for f in os.listdir(log_dir) if f.startswith(stem + ".") and f.endswith(".log"))
    return os.path.join(log_dir, f"{stem}.{n}.log")


def run_queue(
    jobs: Sequence[Job],
    *,
    gpus: Sequence[int | None],
    per_gpu: int,
    root: str,
    launch: Launch,
    deadline_s: float | None,
    retries: int = 1,
    poll_s: float = 2.0,
) -> dict[str, int]:
    """Runs `jobs` on `len(gpus) * per_gpu` slots; returns each started job's last return code.

    `launch(job, gpu, log_path)` starts one job (a `Popen`); a failed job goes back to the end of
    the queue up to `retries` times. No job starts after `deadline_s` seconds. A job with
    `same_as` is not launched: the run of that job is copied into it when it finishes (if that
    one fails for good, this one is queued to train itself).
    """
    log_dir = os.path.join(root, "logs")
    os.makedirs(log_dir, exist_ok=True)
    events = open(os.path.join(root, "session.jsonl"), "a")
    queue = [(job, 0) for job in jobs if not job.same_as]
    waiting: dict[str, list[Job]] = {}  # job name -> the jobs that are the same run
    for job in jobs:
        if job.same_as:
            waiting.setdefault(job.same_as, []).append(job)
    running: dict[int, tuple[Job, int, subprocess.Popen, float]] = {}
    slots = [gpu for gpu in gpus for _ in range(per_gpu)]
    codes: dict[str, int] = {}
    t0 = time.perf_counter()

    def event(**kw):
        events.write(json.dumps({"t": round(time.perf_counter() - t0, 1), **kw}) + "\n")
        events.flush()

    try:
        while queue or running:
            for slot, gpu in enumerate(slots):
                if slot in running or not queue:
                    continue
                if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                    break
                job, attempt = queue.pop(0)
                log = next_log_path(log_dir, job.name)
                running[slot] = (job, attempt, launch(job, gpu, log), time.perf_counter())
                event(start=job.name, gpu=gpu, attempt=attempt, log=os.path.basename(log))
                logging.info("start %s on GPU %s (attempt %d)", job.name, gpu, attempt)
            if deadline_s is not None and time.perf_counter() - t0 > deadline_s and queue:
                for job, _ in queue:
                    event(skipped=job.name, reason="deadline")
                queue = []
            time.sleep(poll_s)
            for slot, (job, attempt, proc, started) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[slot]
                codes[job.name] = rc
                event(end=job.name, rc=rc, seconds=round(time.perf_counter() - started, 1))
                logging.info("end %s rc=%d (%.0f s)", job.name, rc, time.perf_counter() - started)
                if rc != 0 and attempt < retries:
                    queue.append((job, attempt + 1))
                    continue
                for same in waiting.pop(job.name, []):
                    if rc == 0:
                        copy_run(job.run_dir(root), same.run_dir(root))
                        codes[same.name] = 0
                        event(copied=job.name, to=same.name)
                    else:
                        queue.append((dataclasses.replace(same, same_as=""), 0))
    finally:
        for _, _, proc, _ in running.values():  # interrupted: leave no orphans
            proc.terminate()
        events.close()
    return codes


def subprocess_launcher(root: str, extra: Sequence[str], mem_fraction: float = 0.0) -> Launch:
    def launch(job: Job, gpu: int | None, log_path: str) -> subprocess.Popen:
        out = open(log_path, "w")
        return subprocess.Popen(
            job.command(root, extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=job_env(root, gpu, mem_fraction),
        )

    return launch


def bundle(root: str, path: str) -> list[str]:
    """Writes the run logs, SFT evaluation and job logs under `root` to the tarball `path`."""
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in BUNDLE_DIRS_SKIPPED]
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if f.endswith(BUNDLE_SUFFIXES) or rel.startswith("logs/") or f == "session.jsonl":
                names.append(rel)
    with tarfile.open(path, "w:gz") as tar:
        for rel in sorted(names):
            tar.add(os.path.join(root, rel), arcname=rel)
    return names


def unpack_bundle(path: str, dest: str, tag: str) -> list[str]:
    """Unpacks a session's bundle into `<dest>/<table name>/` (e.g. `experiments/results/runs`):
    each table's run logs, the shared SFT evaluation as that table's `sft/`, and the job logs
    and session log of its jobs under `logs/` (prefixed with `tag`, e.g. the session's date).
    Run logs already in `dest` are not overwritten (a run is finished once). An SFT record
    already there that differs (GPU SFT is not bitwise reproducible, so a session that had to
    redo SFT starts its runs from a different checkpoint) is kept too: the new one goes beside
    it as `sft/<tag>_<name>`, so each run's starting point stays on record. Returns the tables.
    """
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        tables = sorted(
            {m.name.split("/")[0] for m in members if m.name.count("/") >= 3}  # t/label/seedK/f
        )
        for m in members:
            parts = m.name.split("/")
            data = tar.extractfile(m).read()
            if parts[0] in tables:
                targets = [os.path.join(dest, *parts)]
            elif parts[0] == "sft":
                targets = [os.path.join(dest, t, *parts) for t in tables]
            elif parts[0] == "logs":
                owner = [t for t in tables if parts[1].startswith(t + "_")] or tables
                targets = [os.path.join(dest, t, "logs", f"{tag}_{parts[1]}") for t in owner]
            else:  # session.jsonl
                targets = [os.path.join(dest, t, "logs", f"{tag}_{parts[-1]}") for t in tables]
            for target in targets:
                if parts[0] in tables and os.path.exists(target):
                    continue
                if parts[0] == "sft" and os.path.exists(target):
                    with open(target, "rb") as f:
                        if f.read() == data:
                            continue
                    target = os.path.join(os.path.dirname(target), f"{tag}_{parts[-1]}")
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(data)
    return tables


def visible_gpus() -> list[int | None]:
    """GPU indices from `nvidia-smi -L` (without initializing JAX here); [None] without GPUs."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return [None]
    n = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    return list(range(n)) or [None]


def run_session(
    table_paths: Sequence[str],
    *,
    root: str,
    per_gpu: int,
    deadline_s: float | None,
    extra: Sequence[str] = (),
    gpus: Sequence[int | None] | None = None,
    bundle_path: str = "",
    done_from: str = "",
    mem_fraction: float = 0.0,
    launch: Launch | None = None,
) -> dict[str, int]:
    """SFT once, then the tables' pending jobs on the GPUs; returns job return codes.
    `done_from`: where the logs of runs finished in earlier sessions are (`adopt_finished`)."""
    t0 = time.perf_counter()
    cfgs = [load_table(p, extra) for p in table_paths]
    check_shared_sft(cfgs)
    gpus = visible_gpus() if gpus is None else list(gpus)
    os.makedirs(root, exist_ok=True)
    link_sft(root, [c.table.name for c in cfgs])
    if done_from:
        for cfg in cfgs:
            adopted = adopt_finished(cfg, root, done_from)
            logging.info("%s: %d runs finished earlier", cfg.table.name, len(adopted))
    jobs = share_identical_runs(cfgs, root, pending_jobs(table_paths, cfgs, root))
    logging.info("%d jobs pending on GPUs %s x %d", len(jobs), gpus, per_gpu)
    if jobs:
        sft_cmd = [
            sys.executable,
            "-m",
            "experiments.paper_table",
            f"--config={table_paths[0]}",
            f"--workdir={os.path.join(root, cfgs[0].table.name)}",  # its `sft` is <root>/sft
            "--sft_only",
            *extra,
        ]
        env = job_env(root, gpus[0])
        os.makedirs(os.path.join(root, "logs"), exist_ok=True)
        with open(os.path.join(root, "logs", "sft.log"), "w") as out:
            subprocess.run(sft_cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=True)
        left = None if deadline_s is None else deadline_s - (time.perf_counter() - t0)
        codes = run_queue(
            jobs,
            gpus=gpus,
            per_gpu=per_gpu,
            root=root,
            launch=launch or subprocess_launcher(root, extra, mem_fraction),
            deadline_s=left,
        )
    else:
        codes = {}
    if bundle_path:
        bundle(root, bundle_path)
    return codes


def main(argv):
    del argv
    f = flags.FLAGS
    if f.unpack:  # back from the device: the bundle into the results tree
        tables = unpack_bundle(f.unpack, f.unpack_to, f.tag)
        print(f"unpacked {tables} into {f.unpack_to}")
        return
    if not f.tables:
        raise app.UsageError("--tables is required (or --unpack)")
    codes = run_session(
        f.tables,
        root=f.root,
        per_gpu=f.per_gpu,
        deadline_s=f.deadline_s or None,
        extra=shlex.split(f.extra),
        bundle_path=f.bundle,
        done_from=f.done_from,
        mem_fraction=f.mem_fraction,
    )
    failed = sorted(k for k, rc in codes.items() if rc)
    print(f"{len(codes) - len(failed)} jobs finished, {len(failed)} failed: {failed}")


if __name__ == "__main__":
    flags.DEFINE_list("tables", None, "table config files (they must share the SFT settings)")
    flags.DEFINE_string("root", "workdir/tables", "one workdir per table under it, SFT shared")
    flags.DEFINE_integer("per_gpu", 3, "runs sharing one GPU")
    flags.DEFINE_float("deadline_s", 0, "start no job after this many seconds (0: no deadline)")
    flags.DEFINE_string("extra", "", "more flags for every paper_table subprocess")
    flags.DEFINE_string("bundle", "", "write run logs to this .tgz at the end")
    flags.DEFINE_float("mem_fraction", 0.0, "cap each job's GPU memory at this share (0: none)")
    flags.DEFINE_string("done_from", "", "logs of runs finished earlier (experiments/results/runs)")
    flags.DEFINE_string("unpack", "", "a bundle to unpack into --unpack_to instead of running")
    flags.DEFINE_string("unpack_to", "experiments/results/runs", "where bundles are unpacked")
    flags.DEFINE_string("tag", "session", "prefix of the unpacked job and session logs")
    app.run(main)
