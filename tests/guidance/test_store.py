"""GuidanceStore as a whole: a disaggregated rollout / trainer pair of processes linked only by
the store (the handshake, async writes, verified reads and gc together)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.guidance.support import RUN, digest, file_store, numpy_guidance

REPO = pathlib.Path(__file__).resolve().parents[2]


def rollout_process(root: str, micro_batch: int, n_steps: int, staleness: int, log: str) -> None:
    """Samples each step with the newest published policy (at most `staleness` behind)."""
    written = []
    with file_store(pathlib.Path(root)) as store:
        for step in range(n_steps):
            version = store.wait_for_version(RUN, max(0, step - staleness), timeout_s=60)
            g = numpy_guidance(1000 * step + micro_batch)
            store.write_async(RUN, step, g, policy_version=version, micro_batch=micro_batch)
            written.append({"step": step, "mb": micro_batch, "version": version, "crc": digest(g)})
    pathlib.Path(log).write_text(json.dumps(written))


def trainer_process(root: str, n_steps: int, n_mb: int, staleness: int, log: str) -> None:
    """Reads each step's micro-batches before the step, publishes the new version, collects."""
    read = []
    with file_store(pathlib.Path(root)) as store:
        version = 0
        store.publish_version(RUN, version)
        for step in range(n_steps):
            for mb in range(n_mb):
                g = store.read(
                    RUN,
                    step,
                    micro_batch=mb,
                    expected_version=version,
                    max_staleness=staleness,
                    timeout_s=60,
                )
                sampled = store.read_manifest(RUN, step, mb)["policy_version"]
                read.append({"step": step, "mb": mb, "version": sampled, "crc": digest(g)})
            version += 1  # the optimizer step
            store.publish_version(RUN, version)
            store.gc(RUN, step)
        read.append({"fallbacks": store.fallback_count, "left": store.entries(RUN)})
    pathlib.Path(log).write_text(json.dumps(read))


def _spawn(fn: str, *args) -> subprocess.Popen:
    code = (
        f"import sys, json; from tests.guidance.test_store import {fn}; "
        f"{fn}(*json.loads(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_disaggregated_rollout_and_trainer_processes(tmp_path):
    n_steps, n_mb, staleness = 5, 2, 1
    root = str(tmp_path / "store")
    logs = {name: str(tmp_path / f"{name}.json") for name in ("trainer", "rollout0", "rollout1")}
    procs = [_spawn("trainer_process", root, n_steps, n_mb, staleness, logs["trainer"])]
    procs += [
        _spawn("rollout_process", root, mb, n_steps, staleness, logs[f"rollout{mb}"])
        for mb in range(n_mb)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out

    written = [
        r for mb in range(n_mb) for r in json.loads(pathlib.Path(logs[f"rollout{mb}"]).read_text())
    ]
    read = json.loads(pathlib.Path(logs["trainer"]).read_text())
    summary = read.pop()
    key = lambda r: (r["step"], r["mb"])
    assert len(written) == n_steps * n_mb
    assert [key(r) for r in read] == sorted(key(r) for r in written)  # each once, in step order
    assert sorted(read, key=key) == sorted(written, key=key)  # same data, same versions
    for r in read:
        assert r["step"] - staleness <= r["version"] <= r["step"]
    assert summary == {"fallbacks": 0, "left": []}
