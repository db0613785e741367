"""The distributed flags: `--coordinator`, `--num_processes` and `--process_id` become a
`DistributedConfig`; inconsistent values stop flag parsing with the config's message."""

from __future__ import annotations

import pytest
from absl import flags

from experiments import harness
from trace_jax.distributed import DistributedConfig


def _parse(*args: str) -> flags.FlagValues:
    values = flags.FlagValues()
    harness.define_distributed_flags(flag_values=values)
    values(["prog", *args])
    return values


def test_distributed_flags_become_the_config():
    assert harness.distributed_from_flags(_parse()) == DistributedConfig()
    values = _parse("--coordinator=10.0.0.1:1234", "--num_processes=2", "--process_id=1")
    assert harness.distributed_from_flags(values) == DistributedConfig(
        coordinator="10.0.0.1:1234", num_processes=2, process_id=1
    )


def test_inconsistent_distributed_flags_stop_flag_parsing():
    with pytest.raises(flags.IllegalFlagValueError, match="need a coordinator"):
        _parse("--num_processes=2", "--process_id=0")
    with pytest.raises(
        flags.IllegalFlagValueError, match=r"must be in \[0, num_processes=2\), got 5"
    ):
        _parse("--coordinator=h:1", "--num_processes=2", "--process_id=5")
