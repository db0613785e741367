"""The job queue over paper tables: jobs, slots, retries, deadline, shared runs, adoption."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tarfile

import pytest

from configs import table1_nvfp4, table4_mxfp4, table5_layers, table7_ptq
from trace_jax.tables import queue
from trace_jax.tables.bundle import EVENTS_FILE
from trace_jax.tables.grid import Table

PATHS = {
    "table1": "configs/table1_nvfp4.py",
    "table4": "configs/table4_mxfp4.py",
    "table5": "configs/table5_layers.py",
    "table7": "configs/table7_ptq.py",
}
MODULES = {"table1": table1_nvfp4, "table4": table4_mxfp4, "table5": table5_layers}
MODULES["table7"] = table7_ptq


def _tables(*names, steps=4, eval_every=2):
    out = []
    for name in names:
        cd = MODULES[name].get_config()
        # A warmup shorter than the shortened runs (the configs' 10 steps outlast 4 x 2).
        cd.rl.update(steps=steps, eval_every=eval_every, warmup_steps=1)
        out.append((PATHS[name], Table.from_config_dict(cd)))
    return out


def _events(root):
    return [json.loads(x) for x in (root / EVENTS_FILE).read_text().splitlines()]


def test_jobs_are_the_unfinished_pairs_and_pick_one_seed(tmp_path):
    tables = _tables("table1", "table4")
    queue.check_shared_sft([t for _, t in tables])
    # table1 trace seed 1 finished (final evaluation at step 3); table4 fp4_qat seed 0 half-way.
    for rel, step in (
        ("table1_nvfp4/trace/seed1", 3),
        ("table4_mxfp4/fp4_qat_mxfp4_w4a8/seed0", 1),
    ):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "rl_eval.jsonl").write_text(json.dumps({"step": step}) + "\n")
    jobs = queue.pending_jobs(tables, str(tmp_path))
    names = [j.name for j in jobs]
    assert len(jobs) == 5 * 3 - 1 + 4 * 3
    assert "table1_nvfp4/trace/seed1" not in names and "table1_nvfp4/trace/seed2" in names
    assert "table4_mxfp4/fp4_qat_mxfp4_w4a8/seed0" in names  # unfinished: still a job
    assert names[0] == "table1_nvfp4/bf16/seed0" and names[-1].startswith("table4_mxfp4/")
    # Seed by seed within a table: every run's seed 0 first (a lost machine leaves whole seeds).
    labels = tables[0][1].labels
    assert names[: len(labels)] == [f"table1_nvfp4/{label}/seed0" for label in labels]
    assert names[len(labels)] == f"table1_nvfp4/{labels[0]}/seed1"
    shared = queue.share_identical_runs([t for _, t in tables], str(tmp_path), jobs)
    assert [j.name for j in shared] == names  # no identical runs here: the same jobs, in order
    job = next(j for j in jobs if j.name == "table1_nvfp4/trace/seed2")
    cmd = job.command("/r", "experiments.paper_table", ["--config.rl.steps=4"])
    assert cmd[1:3] == ["-m", "experiments.paper_table"] and cmd[-1] == "--config.rl.steps=4"
    assert "--runs=trace" in cmd and "--shard=2/3" in cmd and "--workdir=/r/table1_nvfp4" in cmd
    assert "--config.table.chunk_steps=0" in cmd  # one chunk: the run's checkpoints resume it
    # --shard=k/n with --runs=label trains exactly seed k of that run.
    assert tables[0][1].pairs((2, 3), ("trace",)) == [("trace", 2)]


def test_tables_with_different_sft_cannot_share_it():
    (_, t1), (_, t4) = _tables("table1", "table4")
    cd = table4_mxfp4.get_config()
    cd.sft.steps = 1000
    with pytest.raises(ValueError, match="`sft`"):
        queue.check_shared_sft([t1, Table.from_config_dict(cd)])
    queue.check_shared_sft([t1, t4])


def _fake_launcher(fail_first: set[str], log: list, seconds: dict[str, float] | None = None):
    """Jobs are short sleeps (0.3 s unless `seconds` names the job); the named ones fail on
    their first attempt."""

    def launch(job, gpu, log_path):
        attempt = int(log_path.rsplit(".", 2)[-2])
        code = 1 if job.name in fail_first and attempt == 0 else 0
        log.append((job.name, gpu, attempt))
        with open(log_path, "w") as f:
            f.write(f"{job.name} attempt {attempt}\n")
        sleep = (seconds or {}).get(job.name, 0.3)
        script = f"import time, sys; time.sleep({sleep}); sys.exit({code})"
        return subprocess.Popen([sys.executable, "-c", script])

    return launch


def test_queue_fills_slots_retries_failures_once_and_logs(tmp_path):
    jobs = [queue.Job("c.py", "t", f"run{i}", 0, 0, 1) for i in range(5)]
    started = []
    codes = queue.run_queue(
        jobs,
        gpus=[0, 1],
        per_gpu=2,
        root=str(tmp_path),
        launch=_fake_launcher({"t/run1/seed0"}, started),
        deadline_s=None,
        poll_s=0.05,
    )
    assert codes == {j.name: 0 for j in jobs}  # run1 failed once, then succeeded
    assert [a for n, _, a in started if n == "t/run1/seed0"] == [0, 1]
    assert len(started) == 6
    # Never more jobs at once than slots (2 GPUs x 2), and both GPUs used.
    live = peak = 0
    for e in _events(tmp_path):
        live += 1 if "start" in e else -1 if "end" in e else 0
        peak = max(peak, live)
    assert peak == 4 and {g for _, g, _ in started} == {0, 1}
    assert sum("end" in e and e["rc"] == 1 for e in _events(tmp_path)) == 1


def test_a_failed_job_is_retried_once_a_co_tenant_has_ended(tmp_path):
    """An out-of-memory retried beside the same co-tenants fails again: the retry waits for a
    job on its GPU to end; on a GPU where nothing else runs it starts at once."""
    jobs = [queue.Job("c.py", "t", name, 0, 0, 1) for name in ("oom", "long", "other")]
    names = [j.name for j in jobs]
    started = []
    launch = _fake_launcher({names[0], names[2]}, started, seconds={names[1]: 1.5})
    kw = dict(per_gpu=2, root=str(tmp_path), deadline_s=None, poll_s=0.05)
    codes = queue.run_queue(jobs[:2], gpus=[0], launch=launch, **kw)
    assert codes == {n: 0 for n in names[:2]}
    events = _events(tmp_path)
    (retry,) = [e["t"] for e in events if e.get("start") == names[0] and e["attempt"] == 1]
    (long_end,) = [e["t"] for e in events if e.get("end") == names[1]]
    assert retry >= long_end
    codes = queue.run_queue(jobs[2:], gpus=[0], launch=launch, **kw)  # alone on its GPU
    assert codes == {names[2]: 0} and [a for n, _, a in started if n == names[2]] == [0, 1]


def test_a_second_invocation_keeps_the_first_ones_logs(tmp_path):
    job = queue.Job("c.py", "t", "run0", 0, 0, 1)
    kw = dict(gpus=[None], per_gpu=1, root=str(tmp_path), deadline_s=None, poll_s=0.05)
    for _ in range(2):  # the same job queued twice on one root (e.g. after a deadline)
        queue.run_queue([job], launch=_fake_launcher({job.name}, []), **kw)
    logs = sorted(os.listdir(tmp_path / "logs"))
    # The first: attempt 0 failed, its retry passed; the second's attempt is log 2.
    assert logs == [f"t_run0_seed0.{n}.log" for n in range(3)]
    texts = [(tmp_path / "logs" / f).read_text() for f in logs]
    assert texts == [f"t/run0/seed0 attempt {a}\n" for a in (0, 1, 2)]
    assert [e["log"] for e in _events(tmp_path) if "start" in e] == logs


def test_no_job_starts_after_the_deadline(tmp_path):
    jobs = [queue.Job("c.py", "t", f"run{i}", 0, 0, 1) for i in range(3)]
    started = []
    codes = queue.run_queue(
        jobs,
        gpus=[None],
        per_gpu=1,
        root=str(tmp_path),
        launch=_fake_launcher(set(), started),
        deadline_s=0.0,
        poll_s=0.01,
    )
    assert codes == {} and started == []
    assert [e.get("skipped") for e in _events(tmp_path)] == [j.name for j in jobs]


def test_runs_finished_earlier_are_adopted_not_rerun(tmp_path):
    ((path, table),) = _tables("table1")
    done = tmp_path / "results" / "table1_nvfp4"
    for rel, step in (("qarl/seed0", 3), ("qarl/seed1", 1)):  # seed 1 never finished
        (done / rel).mkdir(parents=True)
        (done / rel / "rl_eval.jsonl").write_text(json.dumps({"step": step}) + "\n")
        (done / rel / "rl_metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    root = tmp_path / "root"
    adopted = queue.adopt_finished(table, str(root), str(tmp_path / "results"))
    assert adopted == [str(root / "table1_nvfp4" / "qarl" / "seed0")]
    assert (root / "table1_nvfp4" / "qarl" / "seed0" / "rl_metrics.jsonl").exists()
    note = (root / "table1_nvfp4" / "qarl" / "seed0" / queue.ADOPTED_NOTE).read_text()
    assert note.startswith(str(done / "qarl" / "seed0") + "\n") and "SFT stage" in note
    names = [j.name for j in queue.pending_jobs([(path, table)], str(root))]
    assert "table1_nvfp4/qarl/seed0" not in names and "table1_nvfp4/qarl/seed1" in names
    assert queue.adopt_finished(table, str(root), str(tmp_path / "results")) == []


def test_job_env_pins_the_gpu_and_can_cap_its_memory(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    env = queue.job_env(str(tmp_path), 1, mem_fraction=0.3)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.300"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in queue.job_env(str(tmp_path), 0)
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jax_cache")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in queue.job_env(str(tmp_path), None)  # the CPU


def test_visible_gpus_keep_to_cuda_visible_devices(monkeypatch):
    # A queue confined to some of a host's GPUs (a kernel script on the others) must not place
    # jobs on every GPU `nvidia-smi` lists.
    def smi(*args, **kwargs):
        return subprocess.CompletedProcess(args, 0, stdout="GPU 0: H200\nGPU 1: H200\n")

    monkeypatch.setattr(queue.subprocess, "run", smi)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert queue.visible_gpus() == [0, 1]
    for listed, gpus in (("1", [1]), ("0, 1", [0, 1]), ("", [None]), ("-1", [None])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
        assert queue.visible_gpus() == gpus, listed
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-9999f937")
    with pytest.raises(ValueError, match="GPU indices"):
        queue.visible_gpus()


def test_run_identity_resolves_the_methods_guided_layers():
    (_, t7), (_, t5) = _tables("table7", "table5", steps=100, eval_every=50)
    ident = queue.run_identity
    trace = ident(t7, "trace", 0)
    # TRACE guides the deeper half by default: Table 7's `trace` is Table 5's `trace half`.
    assert trace == ident(t5, "trace half", 0)
    assert trace != ident(t5, "trace all", 0)
    assert trace != ident(t7, "trace", 1)  # another seed
    assert trace != ident(t7, "bf16", 0)


def _writing_launcher(root, fail_always: set[str], log: list):
    """Like `_fake_launcher`, but each job leaves a final evaluation in its run directory."""

    def launch(job, gpu, log_path):
        log.append(job.name)
        run = job.run_dir(root)
        os.makedirs(run, exist_ok=True)
        with open(os.path.join(run, "rl_eval.jsonl"), "w") as f:
            f.write(json.dumps({"step": 99, "from": job.name}) + "\n")
        code = 1 if job.name in fail_always else 0
        return subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])

    return launch


def test_identical_runs_of_two_tables_train_once(tmp_path):
    root = str(tmp_path)
    tables = _tables("table7", "table5", steps=100, eval_every=50)
    # Table 7's trace seed 2 finished in an earlier invocation: Table 5's copy is made at once.
    done = tmp_path / "table7_policies" / "trace" / "seed2"
    done.mkdir(parents=True)
    (done / "rl_eval.jsonl").write_text(json.dumps({"step": 99, "from": "earlier"}) + "\n")
    jobs = queue.share_identical_runs(
        [t for _, t in tables], root, queue.pending_jobs(tables, root)
    )
    same = {j.name: j.same_as for j in jobs if j.same_as}
    assert same == {
        f"table5_layers/trace_half/seed{k}": f"table7_policies/trace/seed{k}" for k in (0, 1)
    }
    assert len(jobs) == 5 + 11 and "table5_layers/trace_half/seed2" not in {j.name for j in jobs}
    copied = tmp_path / "table5_layers" / "trace_half" / "seed2"
    assert "earlier" in (copied / "rl_eval.jsonl").read_text()
    assert (copied / "same_run_as.txt").read_text().strip() == "table7_policies/trace/seed2"

    # The queue trains Table 7's trace seed 0 once and copies it; seed 1 fails for good, so
    # Table 5's `trace half` seed 1 trains itself.
    started = []
    codes = queue.run_queue(
        jobs,
        gpus=[None],
        per_gpu=4,
        root=root,
        launch=_writing_launcher(root, {"table7_policies/trace/seed1"}, started),
        deadline_s=None,
        poll_s=0.05,
    )
    assert "table5_layers/trace_half/seed0" not in started
    assert started.count("table7_policies/trace/seed0") == 1
    assert started.count("table7_policies/trace/seed1") == 2  # retried once
    assert "table5_layers/trace_half/seed1" in started
    assert codes["table5_layers/trace_half/seed0"] == 0 and codes["table7_policies/trace/seed1"]
    half0 = tmp_path / "table5_layers" / "trace_half" / "seed0"
    assert "table7_policies/trace/seed0" in (half0 / "rl_eval.jsonl").read_text()
    copies = [{k: e[k] for k in ("copied", "to")} for e in _events(tmp_path) if "copied" in e]
    assert {"copied": "table7_policies/trace/seed0", "to": "table5_layers/trace_half/seed0"} in (
        copies
    )


def _run_fake_driver(tables, root, started, **kwargs) -> dict[str, int]:
    """`queue.run_tables` of `tables` under `root` with the entry point `fake_driver` (a module
    the test writes) as the SFT stage and the writing launcher's jobs (their labels appended to
    `started`), on one GPU slot group, no deadline."""
    launch = _writing_launcher(str(root), set(), started)
    # The queue polled every 50 ms, not every 2 s: the stand-in jobs end at once.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(queue, "run_queue", functools.partial(queue.run_queue, poll_s=0.05))
        return queue.run_tables(
            tables, module="fake_driver", root=str(root), deadline_s=None, gpus=[None],
            launch=launch, **kwargs,
        )  # fmt: skip


def test_run_tables_runs_the_sft_stage_then_the_jobs(tmp_path, monkeypatch):
    """The driver with stand-ins: the SFT stage is a subprocess of the entry point (here a
    module that records its arguments), then the queue runs the pending jobs; the bundle holds
    their logs."""
    (tmp_path / "fake_driver.py").write_text(
        "import json, sys\n"
        f"open({str(tmp_path / 'sft_args.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    tables = _tables("table7", steps=100, eval_every=50)  # the launcher's runs end at step 99
    root = tmp_path / "root"
    started = []
    codes = _run_fake_driver(
        tables, root, started, per_gpu=6, extra=["--config.rl.steps=4"],
        bundle_path=str(tmp_path / "b.tgz"),
    )  # fmt: skip
    args = json.loads((tmp_path / "sft_args.json").read_text())
    assert args == [
        "--config=configs/table7_ptq.py", f"--workdir={root / 'table7_policies'}", "--sft_only",
        "--config.rl.steps=4",
    ]  # fmt: skip
    assert os.readlink(root / "table7_policies" / "sft") == os.path.join("..", "sft")
    assert sorted(started) == sorted(codes) and len(codes) == 6 and not any(codes.values())
    with tarfile.open(tmp_path / "b.tgz") as tar:
        names = tar.getnames()
    assert "table7_policies/trace/seed2/rl_eval.jsonl" in names and EVENTS_FILE in names
    # Everything finished: a second call starts nothing (not even the SFT stage).
    (tmp_path / "sft_args.json").unlink()
    assert queue.run_tables(tables, module="fake_driver", root=str(root), per_gpu=1,
                            deadline_s=None, gpus=[None]) == {}  # fmt: skip
    assert not (tmp_path / "sft_args.json").exists()


def _adopted(results, label, seed, fingerprint):
    """A run finished in an earlier invocation under `results`, started from the SFT stage
    `fingerprint` (None: a run without that record)."""
    run = results / label / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "rl_eval.jsonl").write_text(json.dumps({"step": 99, "from": "earlier"}) + "\n")
    if fingerprint is not None:
        record = {"rows": [], "params_fingerprint": fingerprint}
        (run / "sft_start.json").write_text(json.dumps(record))


ALL = ("bf16", "fp4_qat", "qarl", "quads", "trace")  # table1's runs


@pytest.mark.parametrize(
    "case, rerun_seeds",
    [
        ("recorded", {1: ALL[2:], 2: ALL}),  # seed 0 whole (f-a), seed 1 on this start (f-new)
        ("mixed", {0: ALL, 1: ALL[2:], 2: ALL}),  # seed 0 mixes f-a and f-c: trained again
        ("mixed_here", {0: ("qarl",), 1: ALL[2:], 2: ALL}),  # f-new but qarl's f-c: qarl again
        ("legacy", {1: ALL[2:], 2: ALL}),  # seed 1 unrecorded, its table's stage was f-new
        ("unknown", {1: ALL, 2: ALL}),  # seed 1 unrecorded, its table's stage unknown
        ("adopt_other_starts", {1: ALL[2:], 2: ALL[2:]}),  # kept as they are
    ],
)
def test_adopted_runs_never_mix_two_sft_starts_within_a_seed(tmp_path, monkeypatch, case,
                                                            rerun_seeds):  # fmt: skip
    """A seed adopted whole from one start is kept; otherwise only the adopted runs that started
    from this stage's start are kept, and the rest of the seed trains here from it. The SFT
    stage runs with the environment's XLA flags only (deterministic ones cost 12-15x)."""
    (tmp_path / "fake_driver.py").write_text(
        "import json, os, sys\n"
        "workdir = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--workdir=')][0]\n"
        "os.makedirs(os.path.join(workdir, 'sft'), exist_ok=True)\n"
        "json.dump({'rows': [], 'params_fingerprint': 'f-new'},\n"
        "          open(os.path.join(workdir, 'sft', 'sft_eval.json'), 'w'))\n"
        f"open({str(tmp_path / 'xla_flags')!r}, 'w').write(os.environ.get('XLA_FLAGS', ''))\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    tables = _tables("table1", steps=100, eval_every=50)
    results = tmp_path / "results" / "table1_nvfp4"
    for label in ALL:  # seed 0: a whole seed from one earlier machine
        start = "f-new" if case == "mixed_here" else "f-a"
        if case.startswith("mixed") and label == "qarl":
            start = "f-c"
        _adopted(results, label, 0, start)
    for label in ALL[:2]:  # seed 1: two runs from this stage's start; seed 2: two from another
        _adopted(results, label, 1, None if case in ("legacy", "unknown") else "f-new")
        _adopted(results, label, 2, "f-b")
    (results / "sft").mkdir()
    if case == "legacy":
        (results / "sft" / "sft_eval.json").write_text(json.dumps({"params_fingerprint": "f-new"}))
    root, started = tmp_path / "root", []
    codes = _run_fake_driver(
        tables, root, started, per_gpu=15, done_from=str(tmp_path / "results"),
        adopt_other_starts=case == "adopt_other_starts",
    )  # fmt: skip
    assert (tmp_path / "xla_flags").read_text().split() == ["--xla_dump_to=/tmp/x"]
    want = {f"table1_nvfp4/{lb}/seed{s}" for s, labels in rerun_seeds.items() for lb in labels}
    assert set(started) == want and set(codes) == want and not any(codes.values())
    for seed in (0, 1, 2):
        for label in ALL:
            run = root / "table1_nvfp4" / label / f"seed{seed}"
            adopted = f"table1_nvfp4/{label}/seed{seed}" not in want
            assert (run / queue.ADOPTED_NOTE).exists() == adopted
            assert ("earlier" in (run / "rl_eval.jsonl").read_text()) == adopted


def test_a_failed_sft_stage_is_an_error_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('stage output'); sys.exit(3)"]
    with pytest.raises(subprocess.CalledProcessError):
        queue.run_sft_stage(cmd, str(tmp_path), None)
    assert "stage output" in (tmp_path / "logs" / "sft.log").read_text()
