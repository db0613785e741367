"""Orbax checkpoints of a policy: its parameters alone (`save_params` / `load_params`: the SFT
warm start, a policy to evaluate) and a run's training state every few steps
(`checkpoint_manager`, `save_train_state` / `restore_train_state`: model parameters and
optimizer state, what a resumed RL run needs).

Every checkpoint is verified when it is restored. Its save records a checksum of each array in
the checkpoint's own metadata (`CHECKSUMS_KEY`), which orbax commits atomically with the arrays,
after an async save finished writing them; a restore recomputes the checksums from the arrays it
read and checks that every float is finite. Orbax's own crc32c covers only the shard index, so
flipped bytes in array data would otherwise load silently. A checkpoint that fails (unreadable,
a checksum mismatch, no checksums, a NaN or Inf) raises `CheckpointCorruptError` naming the
array; `restore_train_state` then falls back to the newest good step with a warning and moves
the bad ones into `<directory>/corrupt/` (kept for inspection; orbax no longer lists them, so
the resumed run can save those steps again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from trace_jax.distributed import host_value, on_primary
from trace_jax.faults import maybe_die

log = logging.getLogger(__name__)

CHECKSUMS_KEY = "trace_jax_checksums"
CORRUPT_DIR = "corrupt"


class CheckpointCorruptError(ValueError):
    """A checkpoint that cannot be read back as it was saved, or holds non-finite values."""


def _path_name(path: tuple) -> str:
    """`model.layers.1.moe.w_gate` for the key path of a leaf of an `nnx.State` tree."""
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        parts.append(str(name))
    if parts and parts[-1] == "value":  # the nnx.Variable wrapper, not part of the name
        parts.pop()
    return ".".join(parts)


def _as_words(x: jax.Array) -> jax.Array:
    """`x`'s bit patterns as a flat uint32 vector (1-, 2-, 4- and 8-byte dtypes)."""
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


# Two weighted sums mod 2^32 with odd weights: any single flipped bit changes both, random
# damage escapes both with probability ~2^-64; integer sums do not depend on the sharding.
_WEIGHTS = tuple(
    (np.uint32(a), np.uint32(b)) for a, b in ((0x9E3779B1, 0x7F4A7C15), (0x85EBCA77, 0x165667B1))
)


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """Two uint32 checksums of one array's bits."""
    words = _as_words(x)
    i = jax.lax.iota(jnp.uint32, words.size)
    weights = [(i * a + b) | np.uint32(1) for a, b in _WEIGHTS]
    return jnp.stack([jnp.sum(words * w, dtype=jnp.uint32) for w in weights])


def _leaf_finite(x: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.asarray(True)


_fingerprints = jax.jit(
    lambda tree: (jax.tree.map(_leaf_checksum, tree), jax.tree.map(_leaf_finite, tree))
)


def _checksums_and_nonfinite(tree) -> tuple[dict[str, str], list[str]]:
    """({leaf name: 16 hex digits}, names of the leaves holding a NaN or Inf) of a pytree of
    arrays (one device round trip; on every process of a multi-process run, each reading the
    same reduced values)."""
    sums, finite = host_value(_fingerprints(tree))
    flat = jax.tree_util.tree_flatten_with_path
    checksums = {_path_name(p): "".join(f"{int(s):08x}" for s in v) for p, v in flat(sums)[0]}
    nonfinite = [_path_name(p) for p, ok in flat(finite)[0] if not ok]
    return checksums, nonfinite


def _checksum_metadata(tree) -> dict[str, dict[str, str]]:
    """The custom metadata a verified save records: `{CHECKSUMS_KEY: {leaf name: checksum}}`."""
    return {CHECKSUMS_KEY: _checksums_and_nonfinite(tree)[0]}


def _verify_restored(tree, metadata: dict | None, where: str) -> None:
    """Raises CheckpointCorruptError unless `tree` (what was restored from `where`) matches the
    checksums its save recorded in `metadata` (its custom metadata) and every float is finite."""
    recorded = (metadata or {}).get(CHECKSUMS_KEY)
    if not recorded:
        raise CheckpointCorruptError(
            f"{where}: no {CHECKSUMS_KEY!r} in its metadata; the checkpoint cannot be verified"
        )
    checksums, nonfinite = _checksums_and_nonfinite(tree)
    if bad := sorted(n for n in {*recorded, *checksums} if recorded.get(n) != checksums.get(n)):
        raise CheckpointCorruptError(
            f"{where}: {len(bad)} arrays differ from what was saved (checksum mismatch), "
            f"first {bad[0]!r}"
        )
    if nonfinite:
        raise CheckpointCorruptError(
            f"{where}: non-finite values (NaN or Inf) in {len(nonfinite)} arrays, first "
            f"{nonfinite[0]!r}: the state was saved so"
        )


def _read_verified(restore, metadata, where: str):
    """`restore()` checked against `metadata()`'s checksums; any read failure becomes a
    CheckpointCorruptError naming `where` (damaged files fail in many orbax and tensorstore
    ways; what matters here is that the checkpoint is unusable)."""
    try:
        custom = metadata().custom_metadata
        restored = restore()
    except Exception as e:
        raise CheckpointCorruptError(f"{where}: unreadable ({type(e).__name__}: {e})") from e
    _verify_restored(restored, custom, where)
    return restored


def params_fingerprint(model: nnx.Module) -> str:
    """A hex sha256 over the checksums of `model`'s `nnx.Param` arrays by name (the ones a save
    records): equal for bit-identical parameters, so two SFT stages, e.g. on two machines, can
    be compared without moving either checkpoint."""
    checksums, _ = _checksums_and_nonfinite(nnx.state(model, nnx.Param))
    return hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest()


def save_params(model: nnx.Module, path: str) -> None:
    """Saves `model`'s `nnx.Param` state, with its checksums, to the directory `path`
    (replacing what is there)."""
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(
            os.path.abspath(path), state, force=True, custom_metadata=_checksum_metadata(state)
        )


def load_params(model: nnx.Module, path: str) -> None:
    """Restores `nnx.Param` state saved by `save_params` into `model` (shapes must match), each
    array read straight into the placement of `model`'s (on every process of a multi-process
    run, each reading its shards). Raises CheckpointCorruptError when it fails verification
    (module docstring)."""
    path = os.path.abspath(path)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        nnx.state(model, nnx.Param),
    )
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no saved parameters at {path}")
    with ocp.StandardCheckpointer() as ckpt:
        restored = _read_verified(
            lambda: ckpt.restore(path, abstract), lambda: ckpt.metadata(path), path
        )
    nnx.update(model, restored)


def checkpoint_manager(directory: str, every: int) -> ocp.CheckpointManager:
    """Step checkpoints in `directory` itself (an RL run's is `<workdir>/rl_checkpoints`): a save
    at every multiple of `every` (or a forced one) is kept, the last two at most."""
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save_step(manager: ocp.CheckpointManager, step: int, state, *, force: bool = False) -> bool:
    """Saves the pytree `state` as `step` with its checksums if the manager's interval (or
    `force`) says so; returns whether it saved. The write finishes in the background."""
    if not (force or manager.should_save(step)):
        return False  # the checksums cost a pass over the state: only for a save
    saved = manager.save(
        step,
        args=ocp.args.StandardSave(state),
        force=force,
        custom_metadata=_checksum_metadata(state),
    )
    maybe_die("checkpoint_save", step)  # TRACE_JAX_FAULT, while the write is in flight
    return saved


def restore_step(manager: ocp.CheckpointManager, step: int, target):
    """`step`'s state, restored into the structure, shapes and shardings of `target` and
    verified; CheckpointCorruptError when it fails (module docstring)."""
    where = f"checkpoint {os.path.join(str(manager.directory), str(step))}"
    return _read_verified(
        lambda: manager.restore(step, args=ocp.args.StandardRestore(target)),
        lambda: manager.metadata(step),
        where,
    )


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
    return save_step(manager, step, _train_state(model, optimizer), force=force)


def _set_aside(manager: ocp.CheckpointManager, steps: list[int]) -> None:
    """Moves the step directories `steps` into `<directory>/corrupt/` (process 0) and rereads
    the step list (every process)."""
    on_primary(lambda: _move_to_corrupt(str(manager.directory), steps), "moving checkpoints")
    manager.reload()


def _move_to_corrupt(directory: str, steps: list[int]) -> None:
    os.makedirs(os.path.join(directory, CORRUPT_DIR), exist_ok=True)
    for step in steps:
        dest, n = os.path.join(directory, CORRUPT_DIR, str(step)), 0
        while os.path.exists(dest):  # the same step failed before, in an earlier attempt
            n += 1
            dest = os.path.join(directory, CORRUPT_DIR, f"{step}.{n}")
        os.replace(os.path.join(directory, str(step)), dest)
        log.warning("moved the corrupt checkpoint of step %d to %s", step, dest)


def restore_train_state(
    manager: ocp.CheckpointManager, step: int, model: nnx.Module, optimizer: nnx.Optimizer
) -> int:
    """Restores the newest good checkpoint at or before `step` (its parameters and optimizer
    state, into `model` and `optimizer` with their current shardings); returns its step.

    A checkpoint that fails verification is skipped with a warning and, once a good one is
    found, moved into `<directory>/corrupt/`. Raises CheckpointCorruptError listing every
    checkpoint's failure when none is good (nothing is moved then).
    """
    target = _train_state(model, optimizer)
    candidates = sorted((s for s in manager.all_steps() if s <= step), reverse=True)
    if not candidates:
        raise FileNotFoundError(f"no checkpoint at or before step {step} in {manager.directory}")
    failures = []
    for candidate in candidates:
        try:
            restored = restore_step(manager, candidate, target)
        except CheckpointCorruptError as e:
            failures.append(str(e))
            log.warning("%s; falling back to the previous checkpoint", e)
            continue
        if failures:
            _set_aside(manager, candidates[: len(failures)])
            log.warning(
                "restored step %d instead of step %d: %d newer checkpoints are corrupt",
                candidate,
                candidates[0],
                len(failures),
            )
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["opt"])
        return candidate
    raise CheckpointCorruptError(
        f"every checkpoint in {manager.directory} fails verification; move the directory "
        "away to start from step 0:\n  " + "\n  ".join(failures)
    )
