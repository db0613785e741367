"""A table's grid: its section, run configs with `rl.*` overrides, shards, benchmark average."""

from __future__ import annotations

import pytest

from configs import table1_nvfp4, table4_mxfp4, table5_layers, table7_ptq
from tests.tables import support
from trace_jax.tables.grid import (
    BENCHMARK_SPLITS,
    Table,
    benchmark_average,
    benchmark_splits,
    run_dir,
    table_section,
)


def _table(**section):
    cd = support.table_config()
    cd.table.update(section)
    return Table.from_config_dict(cd)


def test_every_table_config_converts():
    for module in (table1_nvfp4, table4_mxfp4, table5_layers, table7_ptq):
        table = Table.from_config_dict(module.get_config())
        assert table.seeds == (0, 1, 2) and table.chunk_steps == 25
        for label, overrides in table.runs:
            config = table.run_config(label, 2, "ckpt")
            assert config.seed == 2 and config.rl.init_from == "ckpt"
            assert config.rl.method == overrides["rl.method"]


def test_overrides_reach_the_run_config_grpo_fields_included():
    table = _table(
        runs=(
            ("a", {"rl.method": "fp4_qat"}),
            ("b", {"rl.method": "qarl", "rl.clip_eps_high": 0.28, "rl.guided_layers": "all"}),
        )
    )
    a, b = table.run_config("a", 1), table.run_config("b", 1)
    assert (a.rl.method, a.rl.grpo.clip_eps_high) == ("fp4_qat", 0.2)
    assert (b.rl.method, b.rl.grpo.clip_eps_high, b.rl.guided_layers) == ("qarl", 0.28, "all")
    assert a.rl.grpo.learning_rate == b.rl.grpo.learning_rate == 1e-2  # the base config's
    assert table.experiment.rl.method == "trace" and table.experiment.rl.init_from == ""


@pytest.mark.parametrize(
    "section, match",
    [
        ({"runs": (("x", {"model.preset": "small"}),)}, "unknown override 'model.preset'"),
        ({"runs": (("x", {"rl.nope": 1}),)}, "unknown override 'rl.nope'"),
        ({"runs": (("x", {"rl.init_from": "c"}),)}, "unknown override 'rl.init_from'"),
        ({"runs": (("a b", {}), ("a_b", {}))}, "must be distinct"),
        ({"runs": ()}, "must be distinct"),
        ({"seeds": (0, 0)}, "seeds"),
        ({"chunk_steps": -1}, "chunk_steps"),
        ({"runs": (("x", {"rl.eval_every": 2}),)}, "multiple of rl.eval_every=2"),
        ({"runs": (("x", {"rl.eval_every": 0}),)}, "rl.eval_every=0"),
        ({"runs": (("x", {"rl.method": "nope"}),)}, r"rl\.method must be one of .*'nope'"),
    ],
)
def test_bad_tables_are_refused(section, match):
    with pytest.raises(ValueError, match=match):
        _table(**section)


def test_table_section_fields():
    section = table_section(name="t", seeds=(0,), runs=(("a", {}),))
    assert section.to_dict() == {
        "name": "t", "title": "", "seeds": (0,), "runs": (("a", {}),), "chunk_steps": 25,
    }  # fmt: skip
    with pytest.raises(ValueError, match="no default"):
        table_section(name="t", runs=())
    cd = support.table_config()
    cd.table.unlock()
    cd.table.colour = "red"
    with pytest.raises(ValueError, match=r"unknown Table fields \['colour'\]"):
        Table.from_config_dict(cd)
    with pytest.raises(ValueError, match="no `table` section"):
        Table.from_config_dict(support.tiny.experiment_config())


def test_shards_partition_the_pairs():
    table = Table.from_config_dict(support.table_config())
    pairs = table.pairs()
    assert pairs == [("bf16", 0), ("bf16", 1), ("trace", 0), ("trace", 1)]
    split = [table.pairs((i, 3)) for i in range(3)]
    assert sorted(p for part in split for p in part) == sorted(pairs)
    # Runs named: every seed of them, still split by shard.
    assert table.pairs(labels=("trace",)) == [("trace", 0), ("trace", 1)]
    assert table.pairs((1, 2), ("trace",)) == [("trace", 1)]
    with pytest.raises(ValueError, match="not runs of table t"):
        table.pairs(labels=("trace", "qarl"))
    with pytest.raises(ValueError, match="0 <= i < n"):
        table.pairs((2, 2))


def test_run_dir_and_benchmark_average():
    assert run_dir("w", "trace mxfp4_w4a4", 2) == "w/trace_mxfp4_w4a4/seed2"
    assert BENCHMARK_SPLITS == (
        "arith_countdown_l2",
        "arith_countdown_l3",
        "arith_countdown_l4",
        "program_l2to4",
        "loop_l2",
        "loop_l3",
        "loop_l4",
        "loop_l5",
    )
    splits = ("level1", "arith_countdown_l2", "arith_countdown_l4")
    assert benchmark_splits(splits) == ["arith_countdown_l2", "arith_countdown_l4"]
    scores = {"level1": 0.9, "arith_countdown_l2": 0.2, "arith_countdown_l4": 0.4}
    assert benchmark_average(scores, splits) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="no benchmark split"):
        benchmark_splits(("level1",))
