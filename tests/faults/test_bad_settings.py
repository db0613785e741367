"""Bad settings through the real entry points: each RL and SFT entry point, run as its `__main__`
runs it (`app.run(main)` on a command line), refuses each bad setting and a missing config file
with one line naming it and exit status 1, before any directory is created.

In-process: every case stops before JAX runs anything, so one process serves them all; each
case defines the entry point's flags afresh and removes them after."""

from __future__ import annotations

import importlib
import logging
import os
import sys

import pytest
from absl import app, flags

from trace_jax.rl.logs import THIRD_PARTY_LOGGERS

ENTRY_POINTS = ("main", "sft", "quickstart", "disaggregated")
# (command-line argument, what the one line must say)
CASES = (
    ("--config.sft.batch_size=0", "sft.batch_size must be an int >= 1, got 0"),
    ("--config.sft.batch_size=-4", "sft.batch_size must be an int >= 1, got -4"),
    ("--config.rl.checkpoint_every=0", "rl.checkpoint_every must be an int >= 1, got 0"),
    ("--config.rl.eval_every=-1", "rl.eval_every must be an int >= 0, got -1"),
    ("--config.rl.prompts_per_step=0", "rl.prompts_per_step must be an int >= 1, got 0"),
    ("--config.rl.steps=0", "rl.steps must be an int >= 1, got 0"),
    ("--config=configs/no_such_config.py", "no config file 'configs/no_such_config.py'"),
)


@pytest.fixture
def restored_globals(monkeypatch):
    """Leaves absl's global flags, the root logger's handlers and the third-party loggers' levels
    (which `app.run` and the entry points set) as it found them."""
    defined, parsed = set(flags.FLAGS), flags.FLAGS.is_parsed()
    root = logging.getLogger()
    handlers = list(root.handlers)
    levels = {name: logging.getLogger(name).level for name in THIRD_PARTY_LOGGERS}
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    yield
    for name in set(flags.FLAGS) - defined:
        delattr(flags.FLAGS, name)
    if not parsed:
        flags.FLAGS.unparse_flags()
    root.handlers[:] = handlers
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _no_directory(path, *args, **kwargs):
    raise AssertionError(f"a directory was created before the refusal: {path}")


@pytest.mark.usefixtures("restored_globals")
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize(("argument", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_setting_exits_in_one_line_before_any_directory(
    entry_point, argument, message, tmp_path, monkeypatch, capsys
):
    module = importlib.import_module(f"experiments.{entry_point}")
    workdir = tmp_path / "workdir"
    argv = [f"{entry_point}.py", argument, f"--workdir={workdir}"]
    sys.argv[:] = argv  # ml_collections reads the --config.<field> overrides from sys.argv
    module.define_flags()
    # Any directory made (a workdir, a record, a checkpoint) means work began: fail at once.
    with monkeypatch.context() as patched, pytest.raises(SystemExit) as stopped:
        patched.setattr(os, "makedirs", _no_directory)
        patched.setattr(os, "mkdir", _no_directory)
        app.run(module.main, argv=argv)
    if isinstance(stopped.value.code, str):  # raised by the entry point: Python prints it
        assert stopped.value.code == f"error: invalid experiment config: {message}"
    else:  # a flag that does not parse: absl prints the line and exits with status 1
        assert stopped.value.code == 1
        first, *_ = capsys.readouterr().err.splitlines()
        assert first.startswith("FATAL Flags parsing error: flag --config=") and message in first
    assert not workdir.exists() and not any(tmp_path.iterdir())
