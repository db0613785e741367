"""Paper tables on the GPUs of one machine: their (run, seed) pairs as a queue of detached jobs.

1. The SFT warm start runs once, in `<root>/sft` (every table must share its SFT settings:
   `check_shared_sft`), linked into each table's workdir `<root>/<table name>/sft`; each run
   records the stage it starts from (`trace_jax.tables.train.record_start`). Runs finished
   elsewhere can be adopted (`adopt_finished`): after the SFT stage, a seed adopted whole from
   one start is kept, and otherwise only the adopted runs that started from this stage's start
   (`check_adopted_starts`), so the runs of one seed always start alike.
2. Every (table, run, seed) without a final evaluation is a job, in table order. `gpus x
   per_gpu` slots each run one job at a time: a subprocess of the table driver's entry point
   with `--runs=<label> --shard=<k>/<seeds>` (exactly seed k of that run), pinned to its GPU
   with GPU memory on demand. A failed job (an out-of-memory when co-tenants peak, say) is
   retried once, from its last checkpoint, once a co-tenant has freed its memory: after another
   job on the GPU it failed on has ended, or at once when none runs there. No job starts after
   the deadline; what is unfinished
   then stays a job for the next invocation on the same root.
3. `<root>/queue.jsonl` logs every job's start and end (time, GPU, return code, log file).

A (table, run, seed) that trains exactly what an earlier one trains (`run_identity`: the same
experiment config once the method's guided layers are resolved, e.g. Table 7's `trace` and Table
5's `trace half`) is trained once; its logs are copied into the other table's run directory with
a `same_run_as.txt` naming the source (`copy_run`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from trace_jax.rl.methods import get_method
from trace_jax.rl.sft import FINGERPRINT_KEY, SFT_EVAL
from trace_jax.tables.bundle import ADOPTED_NOTE, BUNDLE_SUFFIXES, EVENTS_FILE, bundle
from trace_jax.tables.grid import Table, run_dir, sft_dir
from trace_jax.tables.train import finished_seeds, start_fingerprint

log = logging.getLogger(__name__)


def run_sft_stage(sft_cmd: list[str], root: str, gpu: int | None) -> None:
    """Runs the SFT stage's command (log: `<root>/logs/sft.log`); a failure raises
    `subprocess.CalledProcessError`.

    Its bits differ from one GPU machine to another (XLA's GPU reductions and autotuning vary
    from run to run), which is why runs record their start and seeds are adopted whole
    (`check_adopted_starts`) rather than the stage made deterministic: with
    `--xla_gpu_deterministic_ops=true` the stage took 1.25 s a step on an H200 against
    0.086-0.105 s without (`experiments/results/runs/sft_deterministic_ops/`)."""
    logs = os.path.join(root, "logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(logs, "sft.log"), "w") as out:
        subprocess.run(
            sft_cmd, stdout=out, stderr=subprocess.STDOUT, env=job_env(root, gpu), check=True
        )


def job_env(root: str, gpu: int | None, mem_fraction: float = 0.0) -> dict[str, str]:
    """A job's environment: pinned to `gpu` (None: no GPU), GPU memory on demand (several runs
    share a GPU), optionally capped at `mem_fraction` of it (0: no cap), compiled programs shared
    through a persistent cache (runs of one method compile alike)."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if mem_fraction:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.3f}"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.abspath(root), "jax_cache"))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


@dataclasses.dataclass(frozen=True)
class Job:
    """One (table, run, seed); `seed_index` is the seed's position among the table's seeds.

    same_as: the job whose run this one is (the same training in another table): it is copied
      from that one, not trained.
    """

    config_path: str
    table: str
    label: str
    seed: int
    seed_index: int
    n_seeds: int
    same_as: str = ""

    @property
    def name(self) -> str:
        return f"{self.table}/{self.label}/seed{self.seed}".replace(" ", "_")

    def run_dir(self, root: str) -> str:
        return run_dir(os.path.join(root, self.table), self.label, self.seed)

    def command(self, root: str, module: str, extra: Sequence[str] = ()) -> list[str]:
        """The job as `python -m <module>` (the table driver's entry point), training exactly
        this seed of this run in one chunk (the run's own checkpoints make it resumable)."""
        return [
            sys.executable,
            "-m",
            module,
            f"--config={self.config_path}",
            f"--workdir={os.path.join(root, self.table)}",
            f"--runs={self.label}",
            f"--shard={self.seed_index}/{self.n_seeds}",
            "--config.table.chunk_steps=0",
            *extra,
        ]


def check_shared_sft(tables: Sequence[Table]) -> None:
    """All tables must train the same SFT warm start (seed, model, tasks, SFT settings)."""
    first = tables[0].experiment
    for table in tables[1:]:
        for section in ("seed", "model", "tasks", "sft"):
            if getattr(table.experiment, section) != getattr(first, section):
                raise ValueError(
                    f"tables {tables[0].name} and {table.name} differ in `{section}`: they "
                    "cannot share one SFT stage; queue them on separate roots"
                )


def pending_jobs(tables: Sequence[tuple[str, Table]], root: str) -> list[Job]:
    """Every (table, run, seed) without a final evaluation under `root`, in table order and
    within a table seed by seed (every run's seed 0, then every run's seed 1, ...): what a
    deadline or a lost machine leaves finished is whole seeds of the table's comparison, each
    from one SFT start; `tables`: (config path, table) pairs."""
    jobs = []
    for path, table in tables:
        workdir = os.path.join(root, table.name)
        done = {label: finished_seeds(table, workdir, label) for label in table.labels}
        for k, seed in enumerate(table.seeds):
            for label in table.labels:
                if seed not in done[label]:
                    jobs.append(Job(path, table.name, label, seed, k, len(table.seeds)))
    return jobs


def run_identity(table: Table, label: str, seed: int) -> str:
    """What a table's (run, seed) trains, as a string: its experiment config with the guided
    layers resolved through the method (TRACE guides the deeper half by default, so Table 7's
    `trace` is Table 5's `trace half`). Tables that share the SFT stage train runs of equal
    identity alike."""
    config = table.run_config(label, seed)
    rl, n_layers = config.rl, config.model.n_layers
    setup = get_method(rl.method).setup(rl.format, n_layers, guided_layers=rl.guided_layers or None)
    setup = dataclasses.replace(
        setup,
        rollout_qcfg=dataclasses.replace(
            setup.rollout_qcfg, guided_layers=setup.rollout_qcfg.layers_guided(n_layers)
        ),
        trainer_qcfg=dataclasses.replace(
            setup.trainer_qcfg, guided_layers=setup.trainer_qcfg.layers_guided(n_layers)
        ),
    )
    unresolved = dataclasses.replace(config, rl=dataclasses.replace(rl, guided_layers=""))
    return repr(unresolved) + repr(setup)


def share_identical_runs(tables: Sequence[Table], root: str, jobs: Sequence[Job]) -> list[Job]:
    """Marks each pending job that trains what an earlier (table, run, seed) trains
    (`run_identity`) as the same as that one: its logs are copied once the first finishes
    (at once if it finished in an earlier invocation). Returns the jobs left, in
    `pending_jobs`' order (seed by seed within a table)."""
    first: dict[str, tuple[str, str]] = {}  # identity -> (job name, run dir)
    pending = {j.name: j for j in jobs}
    out = []
    for table in tables:
        for k, seed in enumerate(table.seeds):
            for label in table.labels:
                job = Job("", table.name, label, seed, k, len(table.seeds))
                name, here = job.name, job.run_dir(root)
                key = run_identity(table, label, seed)
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
    """The logs and evaluations of the run in `src` (not checkpoints or guidance) into `dst`,
    with `same_run_as.txt` naming the source as `<table>/<label>/seed<k>`."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith(BUNDLE_SUFFIXES):
            shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(src))))
    with open(os.path.join(dst, "same_run_as.txt"), "w") as f:
        f.write(os.path.relpath(os.path.abspath(src), root) + "\n")


def adopt_finished(table: Table, root: str, done_from: str) -> list[str]:
    """Copies the runs finished earlier (`<done_from>/<table name>/<label>/seed<k>`, e.g.
    `experiments/results/runs`) into `root`, so their jobs do not run again; returns the run
    directories adopted. Each gets `ADOPTED_NOTE` naming its source. An adopted run started from
    the SFT stage of the invocation that trained it (another machine's, as a rule), which need
    not be this one's: `check_adopted_starts` keeps adopted runs only where they cannot mix two
    starts within a seed."""
    src_workdir = os.path.join(done_from, table.name)
    adopted = []
    for label in table.labels:
        for seed in finished_seeds(table, src_workdir, label):
            dst = run_dir(os.path.join(root, table.name), label, seed)
            if not os.path.exists(dst):
                src = run_dir(src_workdir, label, seed)
                shutil.copytree(src, dst)
                with open(os.path.join(dst, ADOPTED_NOTE), "w") as f:
                    f.write(
                        f"{os.path.abspath(src)}\nfinished in an earlier invocation, from its "
                        "SFT stage (kept where its seed's runs share that start)\n"
                    )
                adopted.append(dst)
    return adopted


def sft_fingerprint(directory: str) -> str | None:
    """The parameters' fingerprint the SFT stage in `directory` recorded (`rl.sft`), or None
    where it has none (no stage, or one recorded before fingerprints)."""
    path = os.path.join(directory, SFT_EVAL)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get(FINGERPRINT_KEY)


def check_adopted_starts(tables: Sequence[Table], root: str, done_from: str) -> list[str]:
    """Removes adopted runs (`adopt_finished`) that would mix two SFT starts within a seed.

    A run's start is the fingerprint it records (`train.start_fingerprint`); a run from before
    that record takes its source table's SFT fingerprint (`<done_from>/<table>/sft`), and none
    at all is unknown. Per table and seed: when every run of the seed is adopted from one known
    start, the seed is kept whole (trained on one earlier machine); otherwise only the adopted
    runs that started from this root's SFT stage (`<root>/sft`) are kept, and the seed's other
    runs train here from that same start. Returns the run directories removed: their jobs
    become pending."""
    here = sft_fingerprint(sft_dir(root))
    removed = []
    for table in tables:
        legacy = sft_fingerprint(sft_dir(os.path.join(done_from, table.name)))
        for seed in table.seeds:
            dirs = [run_dir(os.path.join(root, table.name), lb, seed) for lb in table.labels]
            adopted = {
                d: start_fingerprint(d) or legacy
                for d in dirs
                if os.path.exists(os.path.join(d, ADOPTED_NOTE))
            }
            starts = set(adopted.values())
            if len(adopted) == len(dirs) and len(starts) == 1 and None not in starts:
                continue
            other = [d for d, start in adopted.items() if start is None or start != here]
            for d in other:
                shutil.rmtree(d)
            if other:
                log.warning(
                    "%s seed %d: %d adopted runs from other SFT starts than this stage's (%s): "
                    "trained again here",
                    table.name, seed, len(other), here,
                )  # fmt: skip
            removed += other
    return removed


def link_sft(root: str, tables: Sequence[str]) -> None:
    """Points each table workdir's `sft` at the shared `<root>/sft`."""
    os.makedirs(sft_dir(root), exist_ok=True)
    for name in tables:
        os.makedirs(os.path.join(root, name), exist_ok=True)
        link = sft_dir(os.path.join(root, name))
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "sft"), link)


# launch(job, gpu, log_path) starts one job and returns its process.
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
    """Runs `jobs` on `len(gpus) * per_gpu` slots; returns each finished job's last return code.

    A failed job goes back to the end of the queue up to `retries` times and starts again only
    after another job on the GPU it failed on has ended, or when none runs there (an immediate
    retry beside the same co-tenants meets the same out-of-memory). No job starts after
    `deadline_s` seconds. A job with `same_as` is not launched: the run of that job is copied
    into it when it finishes (if that one fails for good, this one is queued to train itself).
    """
    log_dir = os.path.join(root, "logs")
    os.makedirs(log_dir, exist_ok=True)
    # (job, attempt, gate): a retry's gate is (GPU it failed on, jobs ended there by then).
    queue: list[tuple[Job, int, tuple[int | None, int] | None]] = [
        (job, 0, None) for job in jobs if not job.same_as
    ]
    waiting: dict[str, list[Job]] = {}  # job name -> the jobs that are the same run
    for job in jobs:
        if job.same_as:
            waiting.setdefault(job.same_as, []).append(job)
    running: dict[int, tuple[Job, int, subprocess.Popen, float]] = {}
    slots = [gpu for gpu in gpus for _ in range(per_gpu)]
    codes: dict[str, int] = {}
    ended = dict.fromkeys(gpus, 0)  # jobs ended on each GPU so far
    t0 = time.perf_counter()

    def ready(gate: tuple[int | None, int] | None) -> bool:
        if gate is None:
            return True
        gpu, ended_then = gate
        co_tenants = any(g == gpu for g in (slots[s] for s in running))
        return ended[gpu] > ended_then or not co_tenants

    def late() -> bool:
        return deadline_s is not None and time.perf_counter() - t0 > deadline_s

    with open(os.path.join(root, EVENTS_FILE), "a") as events:

        def event(**kw):
            events.write(json.dumps({"t": round(time.perf_counter() - t0, 1), **kw}) + "\n")
            events.flush()

        try:
            while queue or running:
                for slot, gpu in enumerate(slots):
                    if slot in running or late():
                        continue
                    i = next((i for i, (_, _, gate) in enumerate(queue) if ready(gate)), None)
                    if i is None:
                        continue
                    job, attempt, _ = queue.pop(i)
                    path = next_log_path(log_dir, job.name)
                    running[slot] = (job, attempt, launch(job, gpu, path), time.perf_counter())
                    event(start=job.name, gpu=gpu, attempt=attempt, log=os.path.basename(path))
                    log.info("start %s on GPU %s (attempt %d)", job.name, gpu, attempt)
                if late() and queue:
                    for job, _, _ in queue:
                        event(skipped=job.name, reason="deadline")
                    queue = []
                time.sleep(poll_s)
                for slot, (job, attempt, proc, started) in list(running.items()):
                    if (rc := proc.poll()) is None:
                        continue
                    del running[slot]
                    ended[slots[slot]] += 1
                    codes[job.name] = rc
                    seconds = time.perf_counter() - started
                    event(end=job.name, rc=rc, seconds=round(seconds, 1))
                    log.info("end %s rc=%d (%.0f s)", job.name, rc, seconds)
                    if rc != 0 and attempt < retries:
                        queue.append((job, attempt + 1, (slots[slot], ended[slots[slot]])))
                        continue
                    for same in waiting.pop(job.name, []):
                        if rc == 0:
                            copy_run(job.run_dir(root), same.run_dir(root))
                            codes[same.name] = 0
                            event(copied=job.name, to=same.name)
                        else:
                            queue.append((dataclasses.replace(same, same_as=""), 0, None))
        finally:
            for _, _, proc, _ in running.values():  # interrupted: leave no orphans
                proc.terminate()
    return codes


def subprocess_launcher(
    root: str, module: str, extra: Sequence[str] = (), mem_fraction: float = 0.0
) -> Launch:
    """Launches each job as `Job.command(root, module, extra)` with `job_env`, its output in
    its log file."""

    def launch(job: Job, gpu: int | None, log_path: str) -> subprocess.Popen:
        with open(log_path, "w") as out:  # the child keeps its own descriptor
            return subprocess.Popen(
                job.command(root, module, extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=job_env(root, gpu, mem_fraction),
            )

    return launch


def visible_gpus() -> list[int | None]:
    """GPU indices: those `CUDA_VISIBLE_DEVICES` lists where it is set (a queue confined to some
    of a host's GPUs), else every one `nvidia-smi -L` lists (without initializing JAX here);
    [None] without GPUs."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [i.strip() for i in listed.split(",") if i.strip()]
        if not all(i.isdigit() for i in ids) and ids != ["-1"]:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={listed!r}: the job queue takes GPU indices (0,1,...)"
            )
        return [int(i) for i in ids if i != "-1"] or [None]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return [None]
    n = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    return list(range(n)) or [None]


def run_tables(
    tables: Sequence[tuple[str, Table]],
    *,
    module: str,
    root: str,
    per_gpu: int,
    deadline_s: float | None,
    extra: Sequence[str] = (),
    gpus: Sequence[int | None] | None = None,
    bundle_path: str = "",
    done_from: str = "",
    adopt_other_starts: bool = False,
    mem_fraction: float = 0.0,
    launch: Launch | None = None,
) -> dict[str, int]:
    """The SFT stage once, then the tables' pending jobs on the GPUs; returns job return codes.

    tables: (config path, table) pairs; each job runs `python -m <module> --config=<path>`
      (the table driver's entry point) with `extra` (e.g. `--config.*` overrides).
    gpus: GPU indices (default: every visible GPU); `per_gpu` jobs share each.
    done_from: where the logs of runs finished earlier are (`adopt_finished`). Once the SFT
      stage has run, adopted runs that would mix two starts within a seed are run again
      (`check_adopted_starts`) unless `adopt_other_starts`.
    bundle_path: write the run logs to this tarball at the end (`bundle`).
    """
    t0 = time.perf_counter()
    check_shared_sft([t for _, t in tables])
    gpus = visible_gpus() if gpus is None else list(gpus)
    os.makedirs(root, exist_ok=True)
    link_sft(root, [t.name for _, t in tables])
    if done_from:
        for _, table in tables:
            adopted = adopt_finished(table, root, done_from)
            log.info("%s: %d runs finished earlier", table.name, len(adopted))
    jobs = share_identical_runs([t for _, t in tables], root, pending_jobs(tables, root))
    log.info("%d jobs pending on GPUs %s x %d", len(jobs), gpus, per_gpu)
    codes = {}
    if jobs:
        path, first = tables[0]
        sft_cmd = [
            sys.executable, "-m", module, f"--config={path}",
            f"--workdir={os.path.join(root, first.name)}",  # its `sft` is <root>/sft
            "--sft_only", *extra,
        ]  # fmt: skip
        run_sft_stage(sft_cmd, root, gpus[0])
        if done_from and not adopt_other_starts:
            if check_adopted_starts([t for _, t in tables], root, done_from):
                pending = pending_jobs(tables, root)
                jobs = share_identical_runs([t for _, t in tables], root, pending)
        left = None if deadline_s is None else deadline_s - (time.perf_counter() - t0)
        codes = run_queue(
            jobs,
            gpus=gpus,
            per_gpu=per_gpu,
            root=root,
            launch=launch or subprocess_launcher(root, module, extra, mem_fraction),
            deadline_s=left,
        )
    if bundle_path:
        bundle(root, bundle_path)
    return codes
