r"""Scale-out on the GPUs of one host: parity and step-time split of the multi-process GRPO loop,
the disaggregated pair's throughput and staleness, weak scaling (`configs/multi_gpu.py`).

  python -m experiments.multi_gpu --workdir=/tmp/mg                          # a GPU host
  python -m experiments.multi_gpu --config.measure=disaggregated --workdir=/tmp/mg
  python -m experiments.multi_gpu --config=configs/multi_gpu.py:smoke --workdir=/tmp/mg \
      --outdir=/tmp/mg                                                       # CPU dry run

Sections (`config.measure`; each run as jobs of the project's entry points,
`trace_jax.tables.scale_out`, one after another so that no two share a GPU):
- `parity`: the same global batch (`prompts_per_gpu x gpus` prompts a step) on one GPU, on every
  GPU from one process, and on every GPU from one process each (`jax.distributed` over
  localhost): each run's median step split (rollout / guidance I/O / training) and steps per
  second, and step 1's metrics of the multi-process run against the one-process run on the same
  mesh (`exact_equal`: rewards, lengths, guidance coverage, policy version; `max_rel_diff` of
  the float metrics, which may differ by reduction order).
- `expert_parallel`: parity's global batch with the routed experts split over every GPU
  (`mesh.expert = gpus`), from one process and from one process per GPU: the same split and
  step-1 parity.
- `disaggregated`: the rollout job on GPU 0, the trainer on GPU 1, passing batches, guidance and
  policies only through the exchange (`config.exchange`), at each lag of `config.lags`:
  `disaggregated_steps` steps, throughput and the staleness used.
- `weak_scaling`: `prompts_per_gpu` prompts a step per GPU on 1, 2, 4, ... GPUs (one process
  each): steps and samples per second, and the efficiency against one GPU.
Writes `<outdir>/<name>.{json,md}`; a section measured again replaces its rows, the others stay.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from experiments import harness
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.workdir import recorded_settings
from trace_jax.tables import scale_out
from trace_jax.tables.queue import visible_gpus
from trace_jax.tables.step_time import PHASES, step_times

COLUMNS = (
    "section", "setting", "gpus", "processes", "prompts_per_step", "time_step_s",
    *PHASES, "steps_per_s", "samples_per_s", "efficiency", "staleness_mean", "staleness_max",
    "exact_equal", "max_rel_diff", "wall_s", "measured",
)  # fmt: skip


def _group_size(workdir: str, stage: str = "rl") -> int:
    """Samples per prompt of the run in `workdir`, from the settings it recorded."""
    return int(recorded_settings(workdir, stage)["rl.group_size"])


class Measurement:
    """The jobs of one `experiments.multi_gpu` invocation: `cfg` (`configs/multi_gpu.py`)
    under `workdir`, on `devices` (GPU indices, or host devices when `cpu`)."""

    def __init__(self, cfg, workdir: str, devices: list[int], cpu: bool):
        self.cfg, self.workdir, self.devices, self.cpu = cfg, workdir, devices, cpu
        self.launch = scale_out.Launch(cfg.experiment, tuple(cfg.overrides))

    def rl(
        self, name: str, devices: list[int], processes: int, prompts: int, expert: int = 1
    ) -> dict:
        """One GRPO run (experts split over `expert` devices); its `step_times`, rates and
        metric rows (`rows`)."""
        workdir = os.path.join(self.workdir, name)
        procs = scale_out.rl_job(
            self.launch, workdir, devices, processes, expert=expert,
            **{"rl.steps": self.cfg.steps, "rl.prompts_per_step": prompts},
        )  # fmt: skip
        wall = scale_out.run_job(procs, cpu=self.cpu, timeout_s=self.cfg.timeout_s)
        rows = read_rows(os.path.join(workdir, "rl_metrics.jsonl"))
        times = step_times(rows, self.cfg.skip)
        group = _group_size(workdir)
        return {
            "gpus": len(devices),
            "processes": processes,
            "prompts_per_step": prompts,
            **times,
            "steps_per_s": 1.0 / times["time_step_s"],
            "samples_per_s": prompts * group / times["time_step_s"],
            "wall_s": wall,
            "rows": rows,
        }

    def parity(self) -> list[dict]:
        n, prompts = len(self.devices), self.cfg.prompts_per_gpu * len(self.devices)
        return _with_parity(
            "parity",
            {
                "1 GPU": self.rl("parity_one_gpu", self.devices[:1], 1, prompts),
                f"{n} GPUs, 1 process": self.rl("parity_one_process", self.devices, 1, prompts),
                f"{n} GPUs, {n} processes": self.rl("parity_processes", self.devices, n, prompts),
            },
        )

    def expert_parallel(self) -> list[dict]:
        """Parity's global batch with the routed experts split over every GPU (`mesh.expert =
        gpus`, `mesh.data = 1`: each GPU runs every row, its experts' share of the expert
        matmuls): from one process and from one process per GPU."""
        n, prompts = len(self.devices), self.cfg.prompts_per_gpu * len(self.devices)
        return _with_parity(
            "expert_parallel",
            {
                f"{n} GPUs, 1 process, expert {n}": self.rl(
                    "expert_one_process", self.devices, 1, prompts, expert=n
                ),
                f"{n} GPUs, {n} processes, expert {n}": self.rl(
                    "expert_processes", self.devices, n, prompts, expert=n
                ),
            },
        )

    def disaggregated(self) -> list[dict]:
        prompts, out = self.cfg.prompts_per_gpu, []
        for lag in self.cfg.lags:
            workdir = os.path.join(self.workdir, f"disaggregated_lag{lag}")
            settings = {
                "rl.steps": self.cfg.disaggregated_steps,
                "rl.prompts_per_step": prompts,
                "disaggregated.lag": lag,
            }
            if self.cfg.exchange:
                settings["disaggregated.exchange"] = f"{self.cfg.exchange.rstrip('/')}/lag{lag}/"
            procs = scale_out.disaggregated_job(
                self.launch, workdir, self.devices[0], self.devices[1], **settings
            )
            wall = scale_out.run_job(procs, cpu=self.cpu, timeout_s=self.cfg.timeout_s)
            trainer = os.path.join(workdir, "trainer")
            rows = read_rows(os.path.join(trainer, "rl_metrics.jsonl"))
            group = _group_size(trainer, "disaggregated")
            summary = scale_out.disaggregated_summary(rows, self.cfg.skip, prompts * group)
            out.append(
                {
                    "section": "disaggregated",
                    "setting": f"lag {lag}",
                    "gpus": 2,
                    "processes": 2,
                    "prompts_per_step": prompts,
                    **summary,
                    "wall_s": wall,
                }
            )
        return out

    def weak_scaling(self) -> list[dict]:
        counts = [k for k in (1, 2, 4, 8, 16) if k <= len(self.devices)]
        out = []
        for k in counts:
            r = self.rl(f"weak_{k}", self.devices[:k], k, self.cfg.prompts_per_gpu * k)
            setting = f"{k} GPU" + ("s" if k > 1 else "")
            out.append({"section": "weak_scaling", "setting": setting, **_without_rows(r)})
        for row in out:
            row["efficiency"] = row["samples_per_s"] / (out[0]["samples_per_s"] * row["gpus"])
        return out


def _without_rows(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "rows"}


def _with_parity(section: str, runs: dict[str, dict]) -> list[dict]:
    """The rows of `runs` (setting -> `Measurement.rl` result, the one-process run on the
    section's mesh first among those of several GPUs); each multi-process row with step 1's
    `step_parity` against that one-process run."""
    one = next(r for r in runs.values() if r["gpus"] > 1 and r["processes"] == 1)["rows"]
    step = min(1, len(one) - 1)
    out = []
    for setting, r in runs.items():
        row = {"section": section, "setting": setting, **_without_rows(r)}
        if r["processes"] > 1:
            row.update(scale_out.step_parity(one[step], r["rows"][step]), parity_step=step)
        out.append(row)
    return out


def run(cfg, workdir: str, outdir: str, name: str) -> list[dict]:
    """Measures `cfg.measure`'s sections and writes the results after each (merged with the
    sections of an earlier `<outdir>/<name>.json` not measured now, so a failing section loses
    none measured before it); returns every row written. Bad requests are refused before any
    job starts."""
    unknown = set(cfg.measure) - set(scale_out.SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; known: {scale_out.SECTIONS}")
    gpus = [g for g in visible_gpus() if g is not None]
    cpu = not gpus
    count = cfg.gpus or len(gpus)
    if cpu and not cfg.gpus:
        raise ValueError("no GPU visible: set config.gpus to run the jobs on host devices")
    if not cpu and count > len(gpus):
        raise ValueError(f"config.gpus={count} but {len(gpus)} GPUs are visible")
    if "disaggregated" in cfg.measure and count < 2:
        raise ValueError("the disaggregated pair needs two GPUs")
    if "expert_parallel" in cfg.measure and count < 2:
        raise ValueError("expert parallelism needs two GPUs")
    measurement = Measurement(cfg, workdir, list(range(count)) if cpu else gpus[:count], cpu)
    path = os.path.join(outdir, f"{name}.json")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = [r for r in json.load(f)["rows"] if r["section"] not in cfg.measure]
    order = {s: i for i, s in enumerate(scale_out.SECTIONS)}
    for section in cfg.measure:
        new = getattr(measurement, section)()
        # Each row keeps when it was measured: the table merges sections of several runs.
        measured = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        rows += [{**r, "measured": measured} for r in new]
        rows.sort(key=lambda r: order[r["section"]])
        table = harness.write_table(
            name, rows, COLUMNS, title="Scale-out on one host", outdir=outdir,
            notes=f"Every job: `{cfg.experiment}` with {', '.join(cfg.overrides)}; "
            f"{cfg.steps} steps ({cfg.disaggregated_steps} for the pair), the first {cfg.skip} "
            "left out of the medians. `efficiency`: samples per second over one GPU's, per GPU; "
            "`measured`: when the row's section ended (sections may come from different runs).",
        )  # fmt: skip
        print(table)
    return rows


def main(argv):
    del argv
    f = flags.FLAGS
    run(f.config, f.workdir, f.outdir, f.name)


if __name__ == "__main__":
    harness.define_config_flag("multi_gpu")
    harness.define_result_flags("multi_gpu")
    flags.DEFINE_string("workdir", "workdir/multi_gpu", "the jobs' workdirs and logs")
    app.run(main)
