"""The GPU-session job queue over paper tables: jobs, slots, retries, deadline, bundle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from experiments import table_session

TABLES = ["configs/table1_nvfp4.py", "configs/table4_mxfp4.py"]


def _cfgs(extra=()):
    return [table_session.load_table(p, extra) for p in TABLES]


def test_jobs_are_the_unfinished_pairs_and_pick_one_seed(tmp_path):
    cfgs = _cfgs(["--config.rl.steps=4", "--config.rl.eval_every=2"])
    assert cfgs[0].rl.steps == 4 and cfgs[1].rl.eval_every == 2  # overrides applied
    table_session.check_shared_sft(cfgs)
    # table1 trace seed 1 finished (final evaluation at step 3); table4 fp4_qat seed 0 half-way.
    for rel, step in (
        ("table1_nvfp4/trace/seed1", 3),
        ("table4_mxfp4/fp4_qat mxfp4_w4a8/seed0", 1),
    ):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "rl_eval.jsonl").write_text(json.dumps({"step": step}) + "\n")
    jobs = table_session.pending_jobs(TABLES, cfgs, str(tmp_path))
    names = [j.name for j in jobs]
    assert len(jobs) == 5 * 3 - 1 + 4 * 3
    assert "table1_nvfp4/trace/seed1" not in names and "table1_nvfp4/trace/seed2" in names
    assert "table4_mxfp4/fp4_qat_mxfp4_w4a8/seed0" in names  # unfinished: still a job
    assert names[0] == "table1_nvfp4/bf16/seed0" and names[-1].startswith("table4_mxfp4/")
    job = next(j for j in jobs if j.name == "table1_nvfp4/trace/seed2")
    cmd = job.command("/r", ["--config.rl.steps=4"])
    assert "--runs=trace" in cmd and "--shard=2/3" in cmd and cmd[-1] == "--config.rl.steps=4"
    assert f"--workdir={'/r/table1_nvfp4'}" in cmd
    # --shard=k/n with --runs=label trains exactly seed k of that run.
    from experiments import paper_table

    (pair,) = paper_table.table_pairs(cfgs[0], (2, 3), ("trace",))
    assert pair[0] == "trace" and pair[2] == 2


def test_tables_with_different_sft_cannot_share_a_session():
    cfgs = _cfgs()
    cfgs[1].sft.steps = 10
    with pytest.raises(ValueError, match="`sft`"):
        table_session.check_shared_sft(cfgs)


def _fake_launcher(fail_first: set[str], log: list):
    """Jobs are short sleeps; the named ones fail on their first attempt."""

    def launch(job, gpu, log_path):
        attempt = int(log_path.rsplit(".", 2)[-2])
        code = 1 if job.name in fail_first and attempt == 0 else 0
        log.append((job.name, gpu, attempt))
        with open(log_path, "w") as f:
            f.write(f"{job.name} attempt {attempt}\n")
        script = f"import time, sys; time.sleep(0.3); sys.exit({code})"
        return subprocess.Popen([sys.executable, "-c", script])

    return launch


def test_queue_fills_slots_retries_failures_once_and_logs(tmp_path):
    jobs = [table_session.Job("c.py", "t", f"run{i}", 0, 0, 1) for i in range(5)]
    started = []
    codes = table_session.run_queue(
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
    events = [json.loads(x) for x in (tmp_path / "session.jsonl").read_text().splitlines()]
    live = peak = 0
    for e in events:
        live += 1 if "start" in e else -1 if "end" in e else 0
        peak = max(peak, live)
    assert peak == 4 and {g for _, g, _ in started} == {0, 1}
    assert sum("end" in e and e["rc"] == 1 for e in events) == 1


def test_a_second_invocation_keeps_the_first_ones_logs(tmp_path):
    job = table_session.Job("c.py", "t", "run0", 0, 0, 1)
    kw = dict(gpus=[None], per_gpu=1, root=str(tmp_path), deadline_s=None, poll_s=0.05)
    for _ in range(2):  # the same job in two sessions on one root (e.g. after a deadline)
        table_session.run_queue([job], launch=_fake_launcher({job.name}, []), **kw)
    logs = sorted(os.listdir(tmp_path / "logs"))
    # Session 1: attempt 0 failed, its retry passed; session 2's attempt is log 2.
    assert logs == [f"t_run0_seed0.{n}.log" for n in range(3)]
    texts = [(tmp_path / "logs" / f).read_text() for f in logs]
    assert texts == [f"t/run0/seed0 attempt {a}\n" for a in (0, 1, 2)]
    events = [json.loads(x) for x in (tmp_path / "session.jsonl").read_text().splitlines()]
    assert [e["log"] for e in events if "start" in e] == logs


def test_no_job_starts_after_the_deadline(tmp_path):
    jobs = [table_session.Job("c.py", "t", f"run{i}", 0, 0, 1) for i in range(3)]
    started = []
    codes = table_session.run_queue(
        jobs,
        gpus=[None],
        per_gpu=1,
        root=str(tmp_path),
        launch=_fake_launcher(set(), started),
        deadline_s=0.0,
        poll_s=0.01,
    )
    assert codes == {} and started == []
    events = [json.loads(x) for x in (tmp_path / "session.jsonl").read_text().splitlines()]
    assert [e.get("skipped") for e in events] == [j.name for j in jobs]


def test_bundle_keeps_logs_and_evaluations_only(tmp_path):
    root = tmp_path / "root"
    keep = [
        "t1/trace/seed0/rl_metrics.jsonl",
        "t1/trace/seed0/rl_eval.jsonl",
        "sft/sft_eval.json",
        "sft/sft_metrics.jsonl",
        "logs/t1_trace_seed0.0.log",
        "session.jsonl",
    ]
    drop = [
        "t1/trace/seed0/rl_checkpoints/25/x.json",
        "t1/trace/seed0/guidance/run/step_1/manifest.json",
        "sft/sft_checkpoint/rl_eval.jsonl",
        "t1/trace/seed0/tensorboard/events.out",
    ]
    for rel in keep + drop:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    names = table_session.bundle(str(root), str(tmp_path / "b.tgz"))
    assert sorted(names) == sorted(keep)
    with tarfile.open(tmp_path / "b.tgz") as tar:
        assert sorted(tar.getnames()) == sorted(keep)


def test_runs_finished_in_earlier_sessions_are_adopted_not_rerun(tmp_path):
    cfg = table_session.load_table(TABLES[0], ["--config.rl.steps=4", "--config.rl.eval_every=2"])
    done = tmp_path / "results" / "table1_nvfp4"
    for rel, step in (("qarl/seed0", 3), ("qarl/seed1", 1)):  # seed 1 never finished
        (done / rel).mkdir(parents=True)
        (done / rel / "rl_eval.jsonl").write_text(json.dumps({"step": step}) + "\n")
        (done / rel / "rl_metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    root = tmp_path / "root"
    adopted = table_session.adopt_finished(cfg, str(root), str(tmp_path / "results"))
    assert adopted == [str(root / "table1_nvfp4" / "qarl" / "seed0")]
    assert (root / "table1_nvfp4" / "qarl" / "seed0" / "rl_metrics.jsonl").exists()
    names = [j.name for j in table_session.pending_jobs(TABLES[:1], [cfg], str(root))]
    assert "table1_nvfp4/qarl/seed0" not in names and "table1_nvfp4/qarl/seed1" in names
    assert table_session.adopt_finished(cfg, str(root), str(tmp_path / "results")) == []


def test_job_env_pins_the_gpu_and_can_cap_its_memory(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    env = table_session.job_env(str(tmp_path), 1, mem_fraction=0.3)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.300"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in table_session.job_env(str(tmp_path), 0)
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jax_cache")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in table_session.job_env(str(tmp_path), None)  # the CPU


def test_unpack_bundle_places_runs_sft_and_logs_per_table(tmp_path):
    root = tmp_path / "root"
    files = {
        "t1/trace/seed0/rl_eval.jsonl": "new",
        "t1/bf16/seed0/rl_eval.jsonl": "new",
        "t4/trace_x/seed1/rl_metrics.jsonl": "m",
        "sft/sft_eval.json": "sft",
        "logs/t1_trace_seed0.0.log": "log1",
        "logs/t4_trace_x_seed1.0.log": "log4",
        "logs/sft.log": "sftlog",
        "session.jsonl": "events",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    table_session.bundle(str(root), str(tmp_path / "b.tgz"))
    dest = tmp_path / "runs"
    (dest / "t1" / "bf16" / "seed0").mkdir(parents=True)
    (dest / "t1" / "bf16" / "seed0" / "rl_eval.jsonl").write_text("old")  # finished earlier
    (dest / "t1" / "sft").mkdir()
    (dest / "t1" / "sft" / "sft_eval.json").write_text("sft of an earlier session")
    assert table_session.unpack_bundle(str(tmp_path / "b.tgz"), str(dest), "s6") == ["t1", "t4"]
    assert (dest / "t1" / "trace" / "seed0" / "rl_eval.jsonl").read_text() == "new"
    assert (dest / "t1" / "bf16" / "seed0" / "rl_eval.jsonl").read_text() == "old"
    assert (dest / "t4" / "trace_x" / "seed1" / "rl_metrics.jsonl").read_text() == "m"
    assert (dest / "t1" / "sft" / "sft_eval.json").read_text() == "sft of an earlier session"
    assert (dest / "t1" / "sft" / "s6_sft_eval.json").read_text() == "sft"
    assert (dest / "t4" / "sft" / "sft_eval.json").read_text() == "sft"
    assert not (dest / "t4" / "sft" / "s6_sft_eval.json").exists()
    for t in ("t1", "t4"):
        assert (dest / t / "logs" / "s6_session.jsonl").read_text() == "events"
        assert (dest / t / "logs" / "s6_sft.log").read_text() == "sftlog"
    assert (dest / "t1" / "logs" / "s6_t1_trace_seed0.0.log").exists()
    assert not (dest / "t1" / "logs" / "s6_t4_trace_x_seed1.0.log").exists()


def test_run_identity_resolves_the_methods_guided_layers():
    t7, t5 = (table_session.load_table(p, []) for p in ("configs/table7_ptq.py", TABLE5))
    ident = table_session.run_identity
    trace = ident(t7, "trace", {"rl.method": "trace"}, 0)
    # TRACE guides the deeper half by default: Table 7's `trace` is Table 5's `trace half`.
    assert trace == ident(t5, "trace half", {"rl.method": "trace", "rl.guided_layers": "half"}, 0)
    assert trace != ident(t5, "trace all", {"rl.method": "trace", "rl.guided_layers": "all"}, 0)
    assert trace != ident(t7, "trace", {"rl.method": "trace"}, 1)  # another seed
    assert trace != ident(t7, "bf16", {"rl.method": "bf16"}, 0)


TABLE5 = "configs/table5_layers.py"


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
    paths = ["configs/table7_ptq.py", TABLE5]
    cfgs = [table_session.load_table(p, []) for p in paths]
    # Table 7's trace seed 2 finished in an earlier invocation: Table 5's copy is made at once.
    done = tmp_path / "table7_policies" / "trace" / "seed2"
    done.mkdir(parents=True)
    (done / "rl_eval.jsonl").write_text(json.dumps({"step": 99, "from": "earlier"}) + "\n")
    jobs = table_session.share_identical_runs(
        cfgs, root, table_session.pending_jobs(paths, cfgs, root)
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
    failing = {"table7_policies/trace/seed1"}
    codes = table_session.run_queue(
        jobs,
        gpus=[None],
        per_gpu=4,
        root=root,
        launch=_writing_launcher(root, failing, started),
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
    events = [json.loads(x) for x in open(tmp_path / "session.jsonl")]
    assert {"copied": "table7_policies/trace/seed0", "to": "table5_layers/trace_half/seed0"} in [
        {k: e[k] for k in ("copied", "to")} for e in events if "copied" in e
    ]
