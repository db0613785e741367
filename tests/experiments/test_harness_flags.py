"""The entry points' shared flags: `--config` stops at flag parsing, in one line, when its file
does not load; the library's refusals of settings end a program with a one-line error."""

from __future__ import annotations

import sys

import pytest
from absl import flags

from experiments import harness
from trace_jax.rl.config_dict import ConfigError
from trace_jax.rl.workdir import WorkdirConfigError


@pytest.fixture
def parse(monkeypatch):
    """Parses a command line with `--config` (default `configs/tiny_cpu.py`) defined on flags of
    their own; returns those flags."""

    def parse_args(*args: str) -> flags.FlagValues:
        argv = ["prog", *args]
        monkeypatch.setattr(sys, "argv", argv)  # where ml_collections looks for overrides
        values = flags.FlagValues()
        harness.define_config_flag("tiny_cpu", flag_values=values)
        values(argv)
        return values

    return parse_args


def test_a_config_file_that_does_not_load_stops_flag_parsing_in_one_line(parse, tmp_path):
    with pytest.raises(flags.IllegalFlagValueError, match=r"no config file '.*nope\.py'"):
        parse(f"--config={tmp_path / 'nope.py'}")
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config():\n    raise RuntimeError('no such dataset')\n")
    with pytest.raises(flags.IllegalFlagValueError) as failed:
        parse(f"--config={broken}")
    assert str(failed.value).endswith("failed to load: RuntimeError: no such dataset")
    assert "\n" not in str(failed.value)
    broken.write_text("def get_config(:\n")
    with pytest.raises(flags.IllegalFlagValueError, match="failed to load: SyntaxError"):
        parse(f"--config={broken}")


def test_a_config_that_loads_takes_its_overrides(parse):
    assert parse().config.rl.steps == 20  # the default file
    assert parse("--config.rl.steps=3").config.rl.steps == 3
    with pytest.raises(flags.IllegalFlagValueError, match="unknown config variant 'large'"):
        parse("--config=configs/quickstart.py:large")


def test_refusals_of_settings_exit_with_their_message_and_others_propagate():
    with pytest.raises(SystemExit) as stopped, harness.refusals_exit():
        raise ConfigError("experiment config", [(("sft.batch_size",), "must be >= 1, got 0")])
    want = "error: invalid experiment config: sft.batch_size must be >= 1, got 0"
    assert stopped.value.code == want
    with pytest.raises(SystemExit, match=r"rl\.method: 'trace' -> 'bf16'"), harness.refusals_exit():
        raise WorkdirConfigError("/w", "rl", {"rl.method": ("trace", "bf16")})
    with pytest.raises(KeyError), harness.refusals_exit():  # a bug keeps its traceback
        raise KeyError("x")


def test_smoke_runs_interpret_pallas_only_where_it_cannot_compile():
    from ml_collections import ConfigDict

    from kernels_pallas import common

    with common.lowering_for("cpu"):
        with harness.smoke_interpretation(ConfigDict({"smoke": True})):
            assert common.pallas_target().interpreted
        with harness.smoke_interpretation(ConfigDict({"smoke": False})):
            with pytest.raises(common.PallasUnavailableError, match="cpu"):
                common.pallas_target()
    with common.lowering_for("gpu"):  # a smoke run on a GPU compiles its kernels
        with harness.smoke_interpretation(ConfigDict({"smoke": True})):
            assert not common.pallas_target().interpreted
