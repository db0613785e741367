"""Orbax checkpoints of a policy: its parameters alone (`save_params` / `load_params`: the SFT
warm start, a policy to evaluate) and a run's training state every few steps
(`checkpoint_manager`, `save_train_state` / `restore_train_state`: model parameters and
optimizer state, what a resumed RL run needs)."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx


def save_params(model: nnx.Module, path: str) -> None:
    """Saves `model`'s `nnx.Param` state to the directory `path` (replacing what is there)."""
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(path), nnx.state(model, nnx.Param), force=True)


def load_params(model: nnx.Module, path: str) -> None:
    """Restores `nnx.Param` state saved by `save_params` into `model` (shapes must match)."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.state(model, nnx.Param)
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(os.path.abspath(path), abstract)
    nnx.update(model, restored)


def checkpoint_manager(directory: str, every: int) -> ocp.CheckpointManager:
    """Step checkpoints in `directory` itself (an RL run's is `<workdir>/rl_checkpoints`): a save
    at every multiple of `every` (or a forced one) is kept, the last two at most."""
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def _train_state(model: nnx.Module, optimizer: nnx.Optimizer) -> dict:
    return {"model": nnx.state(model, nnx.Param), "opt": nnx.state(optimizer)}


def save_train_state(
    manager: ocp.CheckpointManager,
    step: int,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    *,
    force: bool = False,
) -> bool:
    """Saves the parameters and optimizer state as `step` if the manager's interval (or `force`)
    says so; returns whether it saved. The write finishes in the background."""
    return manager.save(
        step, args=ocp.args.StandardSave(_train_state(model, optimizer)), force=force
    )


def restore_train_state(
    manager: ocp.CheckpointManager, step: int, model: nnx.Module, optimizer: nnx.Optimizer
) -> None:
    """Restores `step`'s parameters and optimizer state into `model` and `optimizer`, with
    their current shardings."""
    restored = manager.restore(step, args=ocp.args.StandardRestore(_train_state(model, optimizer)))
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["opt"])
