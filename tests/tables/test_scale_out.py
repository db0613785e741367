"""Scale-out jobs: processes pinned to their devices, joined or not, run together and stopped
together on a failure; what their logs say read back (parity of a step, the pair's summary)."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from trace_jax.tables import scale_out

LAUNCH = scale_out.Launch("configs/tiny_cpu.py", ("rl.method=trace",))


def _flag(cmd, name):
    return [a.split("=", 1)[1] for a in cmd if a.startswith(f"--{name}=")]


def test_one_process_sees_every_device_and_n_processes_one_each(tmp_path):
    (one,) = scale_out.rl_job(LAUNCH, str(tmp_path), [2, 3], 1, **{"rl.prompts_per_step": 8})
    assert one.devices == (2, 3) and not _flag(one.cmd, "coordinator")
    assert "--config.mesh.data=2" in one.cmd and "--config.rl.prompts_per_step=8" in one.cmd
    assert "--config.rl.method=trace" in one.cmd and _flag(one.cmd, "config") == [LAUNCH.config]
    procs = scale_out.rl_job(LAUNCH, str(tmp_path), [2, 3], 2)
    assert [p.devices for p in procs] == [(2,), (3,)]
    assert [_flag(p.cmd, "process_id") for p in procs] == [["0"], ["1"]]
    coordinators = {tuple(_flag(p.cmd, "coordinator")) for p in procs}
    assert len(coordinators) == 1 and next(iter(coordinators))[0].startswith("127.0.0.1:")
    assert all("--config.mesh.data=2" in p.cmd and _flag(p.cmd, "num_processes") == ["2"]
               for p in procs)  # fmt: skip
    assert len({p.log for p in procs}) == 2
    with pytest.raises(ValueError, match="one, or one per device"):
        scale_out.rl_job(LAUNCH, str(tmp_path), [0, 1, 2], 2)
    assert not any(a.startswith("--config.mesh.expert") for a in one.cmd)


def test_expert_parallel_jobs_split_the_experts_over_the_devices(tmp_path):
    procs = scale_out.rl_job(LAUNCH, str(tmp_path), [0, 1, 2, 3], 4, expert=2)
    for p in procs:
        assert "--config.mesh.data=2" in p.cmd and "--config.mesh.expert=2" in p.cmd
    (one,) = scale_out.rl_job(LAUNCH, str(tmp_path), [0, 1], 1, expert=2)
    assert "--config.mesh.data=1" in one.cmd and "--config.mesh.expert=2" in one.cmd
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"expert={bad} must be >= 1 and divide the 4"):
            scale_out.rl_job(LAUNCH, str(tmp_path), [0, 1, 2, 3], 1, expert=bad)


def test_the_pair_runs_each_role_on_its_device_through_one_exchange(tmp_path):
    rollout, trainer = scale_out.disaggregated_job(LAUNCH, str(tmp_path), 0, 1, **{"rl.steps": 5})
    assert (rollout.devices, trainer.devices) == ((0,), (1,))
    assert _flag(rollout.cmd, "role") == ["rollout"] and _flag(trainer.cmd, "role") == ["trainer"]
    assert _flag(rollout.cmd, "workdir") != _flag(trainer.cmd, "workdir")
    exchange = [a for a in rollout.cmd if a.startswith("--config.disaggregated.exchange=")]
    assert exchange and exchange == [a for a in trainer.cmd if a.startswith("--config.disag")]


def test_children_see_only_their_devices_and_never_nvlink_multicast(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    proc = scale_out.Proc(("x",), (1, 3), "log")
    gpu = scale_out.proc_env(proc, cpu=False)
    assert gpu["CUDA_VISIBLE_DEVICES"] == "1,3" and gpu["NCCL_NVLS_ENABLE"] == "0"
    assert gpu["NVSHMEM_DISABLE_NVLS"] == "1" and gpu["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    cpu = scale_out.proc_env(proc, cpu=True)
    assert cpu["JAX_PLATFORMS"] == "cpu" and cpu["XLA_FLAGS"].endswith("_count=2")


def _python(tmp_path, name, code):
    return scale_out.Proc((sys.executable, "-c", code), (0,), str(tmp_path / f"{name}.log"))


def test_a_failed_process_stops_the_job_with_its_log(tmp_path):
    ok = _python(tmp_path, "ok", "print('fine')")
    assert scale_out.run_job([ok, ok], cpu=True) < 30
    sleeper = _python(tmp_path, "sleeper", "import time; time.sleep(60)")
    failing = _python(tmp_path, "failing", "import sys; print('the cause'); sys.exit(3)")
    t0 = time.perf_counter()
    with pytest.raises(scale_out.JobFailedError, match="the cause") as e:
        scale_out.run_job([sleeper, failing], cpu=True)
    assert time.perf_counter() - t0 < 30  # the sleeper was stopped, not waited for
    assert "failing.log (exit 3)" in str(e.value)
    with pytest.raises(scale_out.JobFailedError, match=r"sleeper\.log"):
        scale_out.run_job([sleeper], cpu=True, timeout_s=0.5)


def test_step_parity_separates_token_decided_metrics_from_float_sums():
    a = {"step": 1, "reward": 0.5, "response_length": 7.0, "loss": 2.0, "kl": 0.0,
         "time_train_s": 1.0}  # fmt: skip
    b = {**a, "loss": 2.0 * (1 + 3e-6), "time_train_s": 9.0}
    got = scale_out.step_parity(a, b)
    assert got["exact_equal"] and got["worst"] == "loss" and got["compared"] == 4
    np.testing.assert_allclose(got["max_rel_diff"], 3e-6 / (1 + 3e-6), rtol=1e-9)
    assert not scale_out.step_parity(a, {**a, "reward": 0.25})["exact_equal"]


def test_the_pairs_summary_reads_throughput_and_staleness_from_the_trainer_log():
    rng = np.random.default_rng(0)
    rows = [
        {"step": s, "time_step_s": t, "time_wait_rollout_s": w, "max_staleness_used": s % 3,
         "reward": r}
        for s, (t, w, r) in enumerate(rng.random((7, 3)) + 0.1)
    ]  # fmt: skip
    got = scale_out.disaggregated_summary(rows, skip=2, rows_per_step=16)
    steady = rows[2:]
    step = np.median([r["time_step_s"] for r in steady])
    np.testing.assert_allclose(got["time_step_s"], step)
    np.testing.assert_allclose(got["samples_per_s"], 16 / step)
    np.testing.assert_allclose(got["staleness_mean"], np.mean([s % 3 for s in range(2, 7)]))
    assert got["staleness_max"] == 2 and got["steps_timed"] == 5
    with pytest.raises(ValueError, match="no trainer steps"):
        scale_out.disaggregated_summary(rows, skip=7, rows_per_step=16)
