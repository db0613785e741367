"""Two processes of two CPU devices each, joined by `jax.distributed` (gloo collectives) into one
4-device mesh, run the GRPO loop as one process runs it on a 4-device mesh: the TRACE method's
guidance passes through the store, each process samples and scores its own rows, and the two
runs agree at every step, in the evaluation and in the final parameters and optimizer state.

Why not bit for bit: both runs compile the same SPMD program for the same (data) mesh from the
same inputs (rows, PRNG keys and initial weights are functions of the seed and the step), but a
cross-device sum runs as XLA's in-process CPU all-reduce in one and as gloo's all-reduce across
processes in the other, which adds the 4 partial sums in another order: float32 results may
differ in their last bits (measured on the 2-block model: 1 ulp in 3 of the 20 metrics of
a step). So
  * what the sampled tokens decide is equal: rewards, response lengths, guidance coverage, the
    evaluation (the first rollout starts from equal weights; later ones sample the same tokens
    unless a logit moved across a sampling boundary, which these settings do not hit);
  * float metrics agree to `RTOL`: reordering a float32 sum of n terms moves it by at most
    about n * 2**-24 of the summed magnitudes, and the longest sums here run over the batch's
    12 x 29 token positions (n * 2**-24 = 2e-5);
  * parameters and optimizer state agree to `RTOL` in all but a few elements: Adam's first step
    moves an element by lr * g / (|g| + eps), so reduction noise on a gradient near 0 can
    become a move of up to lr there (measured on the 2-block model: about 250 of the 692k
    elements differ at all, each parameter by at most 1e-7). Wrong rows, rewards or advantages
    would change nearly every element instead; no element may differ by more than Adam's
    largest moves, 2 lr per step.

The two processes run the entry point itself (`tests/rl/multiprocess_worker.py`: the flags
`--coordinator`, `--num_processes`, `--process_id`) while this process runs the reference on 4
of the suite's 8 devices.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from tests import tiny
from tests.rl.multiprocess_worker import parity_verifier
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig
from trace_jax.rl.checkpoint import checkpoint_manager, restore_step
from trace_jax.rl.experiment import ExperimentConfig, TaskConfig
from trace_jax.rl.loop import RLLoop
from trace_jax.rl.metrics_log import read_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 3 prompts x 4 samples = 12 rows, 3 per device: the group of rows 4..7 spans both processes
# (rows 0..5 lie on process 0), so its advantages need the other process's rewards. The final
# step evaluates 4 problems, one per device.
SETTINGS = {
    "rl.method": "trace",
    "rl.steps": 2,
    "rl.prompts_per_step": 3,
    "rl.group_size": 4,
    "rl.max_new_tokens": 8,
    "rl.learning_rate": 1e-2,
    "rl.mismatch_every": 0,
    "rl.eval_every": 2,
    "eval.splits": ("level1",),
    "eval.problems_per_split": 4,
    "eval.max_new_tokens": 8,
    "mesh.data": 4,
}
# One block (a block less is about 40% less to compile, in this process and in both of the
# run's): parity across processes needs no second one, and TRACE guides the one block, so its
# guidance still passes through the store.
N_LAYERS = 1
# A seed whose first step, on this model, samples responses the parity verifier scores apart
# within a group (a random policy's responses mostly hold no answer, scored by the question's
# length alone), so the advantages are not all zero (checked after the comparison), and whose
# problems differ in that parity, so a row scored against another row's problem changes its
# reward (of seeds 0 to 11 on one block, only 11 gives both).
SEED = 11
TIMEOUT_S = 400
RTOL = 2e-5
# Metrics the sampled tokens and the settings decide, not float sums.
EXACT = ("reward", "response_length", "guidance_rtn_fallback_rows", "policy_version")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_processes(workdir: str, logs: str) -> list[tuple[subprocess.Popen, str]]:
    """The two processes of the run, started; (process, its log file) each."""
    overrides = [
        f"--config.{k}={v if isinstance(v, str) else repr(v)}" for k, v in SETTINGS.items()
    ]
    env = {
        **os.environ,  # the suite's compilation cache and XLA settings
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONPATH": REPO,
    }
    coordinator = f"127.0.0.1:{_free_port()}"
    started = []
    for rank in range(2):
        command = [
            sys.executable,
            "-m",
            "tests.rl.multiprocess_worker",
            "--config=configs/tiny_cpu.py",
            f"--config.model.n_layers={N_LAYERS}",
            f"--config.seed={SEED}",
            *overrides,
            f"--workdir={workdir}",
            f"--coordinator={coordinator}",
            "--num_processes=2",
            f"--process_id={rank}",
        ]
        log = os.path.join(logs, f"process_{rank}.log")
        with open(log, "w") as out:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out)
        started.append((proc, log))
    return started


def _wait(started: list[tuple[subprocess.Popen, str]]) -> None:
    """Waits for both processes (killing them after `TIMEOUT_S`); a failure shows the end of
    every failed process's log."""
    failed = []
    for proc, log in started:
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode:
            with open(log) as f:
                failed.append(f"{log} exited with {proc.returncode}:\n{f.read()[-3000:]}")
    if failed:
        pytest.fail("\n\n".join(failed))


def _config() -> ExperimentConfig:
    cd = tiny.experiment_config()
    cd.model.n_layers, cd.seed = N_LAYERS, SEED
    for key, value in SETTINGS.items():
        section, field = key.split(".")
        cd[section][field] = value
    return ExperimentConfig.from_config_dict(cd)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_two_processes_equal_one_process_on_four_devices(tmp_path, monkeypatch):
    workdir = str(tmp_path / "two")
    started = _start_processes(workdir, str(tmp_path))
    try:
        monkeypatch.setattr(TaskConfig, "make_verifier", parity_verifier)
        reference = RLLoop(_config(), str(tmp_path / "one"))
        want = reference.run()
    finally:
        _wait(started)

    got = read_rows(os.path.join(workdir, "rl_metrics.jsonl"))
    assert [r["step"] for r in got] == [0, 1]
    for a, b in zip(want, got, strict=True):
        assert sorted(a) == sorted(b)
        for k in sorted(set(a) - {"step"}):
            if k in EXACT:
                assert a[k] == b[k], k
            elif not k.startswith("time_"):
                np.testing.assert_allclose(b[k], a[k], rtol=RTOL, atol=1e-7, err_msg=k)
    # Step 0 rewards some samples of a group and not others: its advantages are not all zero.
    assert 0 < got[0]["reward"] < 1 and got[0]["pg_loss"] != 0
    assert all(r["guidance_rtn_fallback_rows"] == 0 for r in got)
    assert read_rows(os.path.join(workdir, "rl_eval.jsonl")) == read_rows(
        str(tmp_path / "one" / "rl_eval.jsonl")
    )
    with GuidanceStore(GuidanceStoreConfig(kvstore=os.path.join(workdir, "guidance"))) as store:
        assert store.entries(_config().rl.run_id) == []  # every step's entries read and deleted

    # The final checkpoint, saved by both processes together, holds the reference's state.
    target = {"model": nnx.state(reference.model, nnx.Param), "opt": nnx.state(reference.optimizer)}
    manager = checkpoint_manager(os.path.join(workdir, "rl_checkpoints"), 1)
    try:
        assert manager.latest_step() == 1
        saved = restore_step(manager, 1, target)  # verified against its recorded checksums
    finally:
        manager.close()
    far = total = 0
    for x, y in zip(jax.tree.leaves(target), jax.tree.leaves(saved), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        far += int(np.sum(~np.isclose(y, x, rtol=RTOL, atol=0)))
        total += x.size
    assert far < 1e-3 * total, f"{far} of {total} elements differ by more than {RTOL}"
    lr = SETTINGS["rl.learning_rate"] * SETTINGS["rl.steps"]
    for x, y in zip(*(jax.tree.leaves(t["model"]) for t in (target, saved)), strict=True):
        np.testing.assert_array_less(np.abs(np.asarray(y) - np.asarray(x)), 2 * lr)
