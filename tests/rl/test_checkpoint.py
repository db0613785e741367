"""Checkpoints are verified on restore: damaged files, another step's arrays, missing checksums
or a NaN saved in the state are refused with the array's name, and the training state falls back
to the newest good step (the bad ones moved aside)."""

from __future__ import annotations

import logging
import os
import shutil

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from flax import nnx

from tests import tiny
from trace_jax.models import init_model
from trace_jax.rl.checkpoint import (
    CheckpointCorruptError,
    checkpoint_manager,
    load_params,
    params_fingerprint,
    restore_train_state,
    save_params,
    save_train_state,
)


@pytest.fixture
def policy():
    model = init_model(tiny.model_config(), seed=0)
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def _snapshot(model, optimizer) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves((nnx.state(model, nnx.Param), optimizer))]


def _shift(model, optimizer, by: float) -> None:
    """A different state to save: every float of the model and the optimizer moved by `by`."""
    for obj in (model, optimizer):
        state = nnx.state(obj, nnx.Param) if obj is model else nnx.state(obj)
        nnx.update(obj, jax.tree.map(lambda x: x + by if x.dtype.kind == "f" else x, state))


def _largest_array_file(checkpoint: str) -> str:
    files = [os.path.join(d, f) for d, _, fs in os.walk(checkpoint) for f in fs]
    return max((f for f in files if f"{os.sep}d{os.sep}" in f), key=os.path.getsize)


def _flip_bytes(path: str) -> None:
    """A few flipped bits in the data: orbax reads them back silently (zstd keeps incompressible
    floats raw, without a checksum), as wrong values."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for i in (len(data) // 4, len(data) // 2, 3 * len(data) // 4):
            data[i] ^= 0x10
        f.seek(0)
        f.write(data)


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _saved_steps(directory, model, optimizer, steps=(0, 1)) -> list[list[np.ndarray]]:
    """Saves `steps` of distinct states into `directory`; returns the state of each."""
    states = []
    with checkpoint_manager(str(directory), 1) as manager:
        for step in steps:
            _shift(model, optimizer, 1.0)
            assert save_train_state(manager, step, model, optimizer)
            states.append(_snapshot(model, optimizer))
    return states


def _corrupt(kind: str, directory, step: int, model, optimizer) -> None:
    checkpoint = os.path.join(directory, str(step))
    if kind == "flipped bytes":
        _flip_bytes(_largest_array_file(checkpoint))
    elif kind == "truncated":
        _truncate(_largest_array_file(checkpoint))
    elif kind == "another step's arrays":  # readable and finite: only the checksums tell
        shutil.rmtree(os.path.join(checkpoint, "default"))
        shutil.copytree(
            os.path.join(directory, str(step - 1), "default"), os.path.join(checkpoint, "default")
        )
    elif kind == "no checksums":  # saved without `save_train_state`
        shutil.rmtree(checkpoint)
        with checkpoint_manager(str(directory), 1) as manager:
            state = {"model": nnx.state(model, nnx.Param), "opt": nnx.state(optimizer)}
            manager.save(step, args=ocp.args.StandardSave(state))
    elif kind == "NaN saved":
        shutil.rmtree(checkpoint)
        w = model.layers[1].moe.w_gate
        w[...] = w[...].at[0, 0, 0].set(np.nan)
        with checkpoint_manager(str(directory), 1) as manager:
            save_train_state(manager, step, model, optimizer)


@pytest.mark.parametrize(
    "kind",
    ["flipped bytes", "truncated", "another step's arrays", "no checksums", "NaN saved"],
)
def test_corrupt_latest_falls_back_to_the_previous_step(tmp_path, policy, caplog, kind):
    model, optimizer = policy
    directory = tmp_path / "ckpt"
    states = _saved_steps(directory, model, optimizer)
    _corrupt(kind, directory, 1, model, optimizer)
    _shift(model, optimizer, 5.0)
    with caplog.at_level(logging.WARNING), checkpoint_manager(str(directory), 1) as manager:
        assert restore_train_state(manager, 1, model, optimizer) == 0
        assert manager.all_steps() == [0]  # the bad step is moved aside: it can be saved again
        restored = _snapshot(model, optimizer)
        assert save_train_state(manager, 1, model, optimizer)
    for got, saved in zip(restored, states[0], strict=True):
        np.testing.assert_array_equal(got, saved)
    assert os.listdir(directory / "corrupt") == ["1"]
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"{directory}/1" in warnings and "restored step 0 instead of step 1" in warnings
    if kind == "NaN saved":
        assert "non-finite" in warnings and "'model.layers.1.moe.w_gate'" in warnings
    if kind in ("flipped bytes", "another step's arrays"):
        assert "checksum mismatch" in warnings


def test_every_checkpoint_corrupt_is_a_clear_error(tmp_path, policy):
    model, optimizer = policy
    directory = tmp_path / "ckpt"
    _saved_steps(directory, model, optimizer)
    for step in (0, 1):
        _flip_bytes(_largest_array_file(str(directory / str(step))))
    with checkpoint_manager(str(directory), 1) as manager:
        with pytest.raises(CheckpointCorruptError, match="every checkpoint") as info:
            restore_train_state(manager, 1, model, optimizer)
        assert manager.all_steps() == [0, 1]  # nothing moved when nothing is good
    assert f"{directory}/0" in str(info.value) and f"{directory}/1" in str(info.value)


def test_params_round_trip_and_refuse_damage_or_nan(tmp_path, policy):
    model, _ = policy
    fresh = init_model(tiny.model_config(), seed=1)
    save_params(model, str(tmp_path / "good"))
    load_params(fresh, str(tmp_path / "good"))
    for a, b in zip(_snapshot(fresh, None), _snapshot(model, None), strict=True):
        np.testing.assert_array_equal(a, b)

    # The fingerprint follows the parameters' bits: equal after the round trip, not for a
    # model of another seed, nor after one element moves by one ulp.
    assert params_fingerprint(fresh) == params_fingerprint(model)
    assert params_fingerprint(init_model(tiny.model_config(), seed=1)) != params_fingerprint(model)
    w = model.layers[0].attn.w_q
    before = params_fingerprint(model)
    w[...] = w[...].at[0, 0, 0].set(np.nextafter(w[...][0, 0, 0], np.inf, dtype=w[...].dtype))
    assert params_fingerprint(model) != before

    # Flipped bits in a data file: read back as wrong values (the checksums catch them) or, where
    # they land in a zstd frame's coding (the file's layout varies from run to run), unreadable.
    save_params(model, str(tmp_path / "flipped"))
    _flip_bytes(_largest_array_file(str(tmp_path / "flipped")))
    with pytest.raises(CheckpointCorruptError, match=r"flipped.*(checksum mismatch|unreadable)"):
        load_params(fresh, str(tmp_path / "flipped"))
    # One element one ulp off, written through tensorstore (a valid file with other values):
    # only the checksums can tell.
    save_params(model, str(tmp_path / "ulp"))
    stored = ts.open({
        "driver": "zarr", "path": "layers.1.moe.w_up.value",
        "kvstore": {"driver": "ocdbt", "base": f"file://{tmp_path / 'ulp'}"},
    }).result()  # fmt: skip
    x = stored[0, 0, 0].read().result()
    stored[0, 0, 0].write(np.nextafter(x, np.inf, dtype=x.dtype)).result()
    with pytest.raises(CheckpointCorruptError, match=r"ulp: 1 arrays differ .*checksum mismatch"):
        load_params(fresh, str(tmp_path / "ulp"))

    w = model.layers[0].attn.w_k
    w[...] = w[...].at[0, 0, 0].set(np.inf)
    save_params(model, str(tmp_path / "inf"))
    with pytest.raises(CheckpointCorruptError, match=r"non-finite .*'layers\.0\.attn\.w_k'"):
        load_params(fresh, str(tmp_path / "inf"))
