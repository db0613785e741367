"""`trace_jax.distributed` in one process: a `DistributedConfig` names each inconsistent setting;
the helpers that split a batch by process find every row here (two processes:
`tests/rl/test_multiprocess.py`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax.distributed import (
    DistributedConfig,
    check_mesh_spans_processes,
    host_value,
    initialize,
    on_primary,
    process_rows,
    read_rows,
    rows_from_local,
)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"coordinator": "auto"},
        {"coordinator": "auto", "num_processes": 4, "process_id": 3},
        {"coordinator": "10.0.0.1:1234", "num_processes": 2, "process_id": 1},
    ],
)
def test_consistent_settings(settings):
    assert DistributedConfig(**settings).joins == bool(settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_processes": 2, "process_id": 0}, "need a coordinator"),
        ({"coordinator": "h:1", "num_processes": 2}, "needs num_processes and process_id"),
        ({"coordinator": "10.0.0.1", "num_processes": 2, "process_id": 0}, "must be 'host:port'"),
        (
            {"coordinator": "h:1", "num_processes": 2, "process_id": 2},
            r"process_id must be in \[0, num_processes=2\), got 2",
        ),
        ({"coordinator": "h:1", "num_processes": 0, "process_id": 0}, "must be >= 1, got 0"),
        ({"coordinator": "auto", "process_id": True}, "must be an int or None, got True"),
    ],
)
def test_inconsistent_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**settings)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_one_process_holds_every_row_of_a_split_batch():
    mesh = jax.make_mesh((4,), ("data",))
    rows = NamedSharding(mesh, P("data"))
    assert process_rows(rows, 8) == process_rows(None, 8) == slice(0, 8)
    x = np.arange(16, dtype=np.int32).reshape(8, 2)
    placed = rows_from_local(x, rows, 8)
    assert placed.sharding == rows
    np.testing.assert_array_equal(read_rows(placed, slice(2, 6)), x[2:6])
    np.testing.assert_array_equal(host_value({"x": placed})["x"], x)
    assert on_primary(lambda: 3, "three") == 3
    with pytest.raises(KeyError):
        on_primary(lambda: {}["missing"], "a lookup")
    initialize(DistributedConfig())  # one process: nothing to join, even after the backend starts
    check_mesh_spans_processes(mesh)
