"""A paper table's grid: every (run, seed) of one experiment config, its directory and config.

A table config is an experiment ConfigDict (`trace_jax.rl.experiment.experiment_config_dict`)
plus a `table` section (`table_section`):

  name:        result file stem and the table's directory name, e.g. "table1_nvfp4"
  title:       one line, the heading of the written table
  seeds:       training seeds; every run trains each one
  runs:        (label, overrides) per row of the table; overrides map `rl.<field>` (any field of
               the `rl` section, GRPO hyper-parameters such as `rl.clip_eps_high` included) to
               the run's value
  chunk_steps: GRPO steps per resumable chunk of a run (0: a run in one go)

A run trains from the table's SFT warm start (`<workdir>/sft`) in `<workdir>/<label>/seed<k>`
(`run_dir`). Scores are pass@1 per held-out split; `average` is always the mean over the
benchmark splits (`BENCHMARK_SPLITS`: those standing in for a paper benchmark,
`trace_jax.tasks.SplitSpec.stands_for`), never over `level1`, the training distribution.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from trace_jax.rl.config_dict import from_section, section_config_dict
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tasks.splits import SPLITS

BENCHMARK_SPLITS = tuple(name for name, spec in SPLITS.items() if spec.stands_for)


def benchmark_splits(splits: Sequence[str]) -> list[str]:
    """The benchmark splits (stand-ins for the paper's benchmarks) among `splits`, in their
    order."""
    bench = [s for s in splits if s in BENCHMARK_SPLITS]
    if not bench:
        raise ValueError(
            f"no benchmark split among {list(splits)}: expected some of {BENCHMARK_SPLITS}"
        )
    return bench


def benchmark_average(scores: Mapping[str, float], splits: Sequence[str]) -> float:
    """The mean of `scores` (pass@1 by split) over the benchmark splits among `splits`."""
    return float(np.mean([scores[s] for s in benchmark_splits(splits)]))


def run_dir(workdir: str, label: str, seed: int) -> str:
    """`<workdir>/<label>/seed<k>`, spaces in the label (e.g. "trace mxfp4_w4a4") as "_"."""
    return os.path.join(workdir, label.replace(" ", "_"), f"seed{seed}")


def sft_dir(workdir: str) -> str:
    """Where a table's SFT warm start lives: `<workdir>/sft` (its checkpoint `sft_checkpoint`)."""
    return os.path.join(workdir, "sft")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Table:
    """One paper-table analog: its runs x seeds over one experiment config.

    Attributes:
      name, title, seeds, runs, chunk_steps: the `table` section (module docstring).
      base: the experiment ConfigDict every run starts from (the config without `table`).
    """

    name: str
    title: str = ""
    seeds: tuple[int, ...]
    runs: tuple[tuple[str, Mapping[str, Any]], ...]
    chunk_steps: int = 25
    base: ml_collections.ConfigDict

    def __post_init__(self):
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        runs = tuple((str(lb), types.MappingProxyType(dict(ov))) for lb, ov in self.runs)
        object.__setattr__(self, "runs", runs)
        if not self.name or "/" in self.name:
            raise ValueError(f"table name {self.name!r}: expected a non-empty file stem")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"table {self.name}: seeds {self.seeds} must be distinct, at least 1")
        dirs = [lb.replace(" ", "_") for lb, _ in runs]
        if not runs or len(set(dirs)) != len(dirs):
            raise ValueError(
                f"table {self.name}: run labels {[lb for lb, _ in runs]} must be distinct (also "
                "with spaces as '_': they name the run directories), at least 1"
            )
        if self.chunk_steps < 0:
            raise ValueError(f"table {self.name}: chunk_steps={self.chunk_steps} must be >= 0")
        steps = {}
        for label, overrides in runs:
            for key in overrides:
                section, _, field = key.partition(".")
                if section != "rl" or field not in self.base.rl or field == "init_from":
                    raise ValueError(
                        f"table run {label!r}: unknown override {key!r}: expected rl.<field> of "
                        f"{sorted(set(self.base.rl) - {'init_from'})} (rl.init_from is the "
                        "table's SFT checkpoint)"
                    )
            rl = self.run_config(label, self.seeds[0]).rl
            if not rl.eval_every or rl.steps % rl.eval_every:
                raise ValueError(
                    f"table run {label!r}: rl.steps={rl.steps} must be a multiple of "
                    f"rl.eval_every={rl.eval_every} (a run ends with its final evaluation)"
                )
            steps[label] = rl.steps
        object.__setattr__(self, "_steps", steps)

    @classmethod
    def from_config_dict(cls, cd: ml_collections.ConfigDict) -> Table:
        """The table of a table config (`cd.table` and the experiment config around it)."""
        if "table" not in cd:
            raise ValueError("not a table config: it has no `table` section")
        base = cd.copy_and_resolve_references()
        base.unlock()  # a copy of the locked `--config`: its `table` section goes
        del base["table"]
        base.lock()
        return from_section(cls, {**cd.table.to_dict(), "base": base})

    @functools.cached_property
    def experiment(self) -> ExperimentConfig:
        """The experiment config the runs share (no run's overrides; the SFT stage's config)."""
        return ExperimentConfig.from_config_dict(self.base)

    @property
    def labels(self) -> list[str]:
        return [label for label, _ in self.runs]

    def overrides(self, label: str) -> Mapping[str, Any]:
        """Run `label`'s `rl.<field>` overrides."""
        for lb, overrides in self.runs:
            if lb == label:
                return overrides
        raise ValueError(f"{label!r} is not a run of table {self.name}: {self.labels}")

    def run_config(self, label: str, seed: int, sft_checkpoint: str = "") -> ExperimentConfig:
        """The experiment config of one (run, seed), starting from `sft_checkpoint` ("" = a
        random initialization)."""
        c = self.base.copy_and_resolve_references()
        for key, value in self.overrides(label).items():
            c.rl[key.partition(".")[2]] = value
        c.seed = seed
        c.rl.init_from = sft_checkpoint
        return ExperimentConfig.from_config_dict(c)

    def steps(self, label: str) -> int:
        """GRPO steps of run `label` (its final evaluation is at step `steps - 1`)."""
        self.overrides(label)  # raises for a label not in the table
        return self._steps[label]

    def pairs(
        self, shard: tuple[int, int] = (0, 1), labels: Sequence[str] = ()
    ) -> list[tuple[str, int]]:
        """The (label, seed) pairs worker `shard = (i, n)` trains: pairs i, i + n, ... of the
        runs named in `labels` (all runs when empty), each run's seeds in order."""
        if unknown := sorted(set(labels) - set(self.labels)):
            raise ValueError(f"runs {unknown} are not runs of table {self.name}: {self.labels}")
        i, n = shard
        if not 0 <= i < n:
            raise ValueError(f"shard {shard}: expected (i, n) with 0 <= i < n")
        pairs = [(lb, s) for lb in self.labels if not labels or lb in labels for s in self.seeds]
        return pairs[i::n]


def table_section(**values: Any) -> ml_collections.ConfigDict:
    """A table config's `table` section: `name`, `seeds` and `runs` given, `title` and
    `chunk_steps` at their defaults unless given."""
    if "base" in values:
        raise ValueError("`base` is the experiment config around the section, not a field of it")
    section = section_config_dict(Table, base=None, **values)
    del section["base"]
    return section
