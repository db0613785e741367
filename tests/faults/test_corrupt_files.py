"""Damaged files under a run: a flipped byte in the newest RL checkpoint (the rerun falls back to
the previous one, with a warning, and ends as the uninterrupted run), a NaN in every checkpoint
(refused, naming the parameter), a deleted guidance chunk (refused, naming the entry)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
import shutil

import numpy as np
import pytest

from experiments import main as rl_entry
from tests.faults import runs
from trace_jax.guidance import GuidanceCorruptError
from trace_jax.rl.checkpoint import CheckpointCorruptError
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.loop import RLLoop

# Every test here runs the shared steps in-process: one worker, one compilation of them.
pytestmark = pytest.mark.xdist_group("uninterrupted_run")
NEWEST, PREVIOUS = runs.STEPS - 1, runs.STEPS - 2


def _copy(reference_run, tmp_path):
    workdir = tmp_path / "rl"
    shutil.copytree(reference_run.workdir, workdir)
    return workdir


def _largest_file(directory, under: str) -> str:
    """The largest file below `directory` in a folder named `under`, or named `under.<...>`
    (zarr3 chunk keys with "." separators, `trace_jax.guidance.layout`)."""
    root = pathlib.Path(directory)
    files = [pathlib.Path(d, f).relative_to(root) for d, _, fs in os.walk(root) for f in fs]
    found = [f for f in files if under in f.parent.parts or f.name.startswith(f"{under}.")]
    return str(max((root / f for f in found), key=os.path.getsize))


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_and_ends_the_same(
    reference_run, tmp_path, caplog
):
    workdir = _copy(reference_run, tmp_path)
    checkpoint = workdir / "rl_checkpoints" / str(NEWEST)
    data = _largest_file(checkpoint, "d")  # orbax's array data
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))
    with caplog.at_level(logging.WARNING, logger="trace_jax"):
        rerun = rl_entry.run(runs.config_dict(), str(workdir))
    assert [h["step"] for h in rerun] == [NEWEST]  # redone from the previous checkpoint
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"{checkpoint}: " in warned, warned
    assert f"restored step {PREVIOUS} instead of step {NEWEST}" in warned, warned
    assert (workdir / "rl_checkpoints" / "corrupt" / str(NEWEST)).is_dir()  # kept, set aside
    runs.assert_same_run(workdir, reference_run)


def test_a_nan_in_every_checkpoint_is_refused_naming_the_parameter(reference_run, tmp_path):
    """Both kept checkpoints hold a NaN in one expert weight, saved with matching checksums (as a
    diverged run would save them): the rerun restores neither and says which parameter."""
    workdir = _copy(reference_run, tmp_path)
    config = ExperimentConfig.from_config_dict(runs.config_dict())
    with RLLoop(config, str(workdir)) as loop:
        loop.restore()
        w = loop.model.layers[0].moe.w_gate
        w[...] = w[...].at[0, 0, 0].set(np.nan)
        for step in (PREVIOUS, NEWEST):
            shutil.rmtree(workdir / "rl_checkpoints" / str(step))
        loop.checkpoints.reload()
        for step in (PREVIOUS, NEWEST):
            loop.save(step, force=True)
    with pytest.raises(CheckpointCorruptError, match="every checkpoint") as refused:
        rl_entry.run(runs.config_dict(), str(workdir))
    for step in (PREVIOUS, NEWEST):
        named = f"rl_checkpoints/{step}: non-finite values (NaN or Inf) in 1 arrays, first "
        assert f"{named}'model.layers.0.moe.w_gate'" in str(refused.value), refused.value
    assert sorted(os.listdir(workdir / "rl_checkpoints")) == [str(PREVIOUS), str(NEWEST)]
    assert runs.logged_rows(workdir) == reference_run.rows  # nothing run, nothing logged


def test_a_deleted_guidance_chunk_is_refused_naming_the_entry(tmp_path):
    """A step's committed guidance loses a chunk before the trainer reads it back."""
    config = ExperimentConfig.from_config_dict(runs.config_dict())
    with RLLoop(config, str(tmp_path / "rl")) as loop:
        batch = loop.rollout_step(0)
        writes = loop.publish_guidance(batch)
        concurrent.futures.wait(writes)
        entry = tmp_path / "rl" / "guidance" / config.rl.run_id / "step_0000000000" / "mb_00000"
        os.remove(_largest_file(entry, "c"))  # a zarr3 chunk of the committed entry
        with pytest.raises(GuidanceCorruptError) as refused:
            loop.train_step(batch, writes)
    name = f"guidance[run={config.rl.run_id!r}, step=0, micro_batch=0]"
    message = str(refused.value)
    assert message.startswith(name) and "is missing" in message, message  # the chunk, by path
