r"""Rollout and training as separate processes, linked only by files in a shared workdir.

  python -m experiments.disaggregated --config=configs/tiny_cpu.py --workdir=/tmp/trace_dis \
      --role=both            # or run --role=rollout and --role=trainer in two shells / hosts
  ... --config.disaggregated.lag=1   # the rollout of step t + 1 overlaps training step t

`trace_jax.rl.disaggregated` describes the handshake (policy checkpoints, rollout files, the
guidance store) and what each process writes. `--role=both` starts the two roles as child
processes of this one, with the same flags.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from absl import app, flags

from experiments import harness
from trace_jax.rl.disaggregated import run_rollout, run_trainer
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.logs import quiet_third_party

ROLES = ("trainer", "rollout")


def role_commands(argv: Sequence[str]) -> list[list[str]]:
    """The child processes of `--role=both`: this module with `argv`'s flags, once per role."""
    args = [a for a in argv[1:] if not a.startswith("--role")]
    cmd = [sys.executable, "-m", "experiments.disaggregated", *args]
    return [[*cmd, f"--role={role}"] for role in ROLES]


def main(argv):
    del argv  # flags stripped: the children get this process's command line
    f = flags.FLAGS
    quiet_third_party(f.verbose)
    config = ExperimentConfig.from_config_dict(f.config)  # refuses a lag beyond max_staleness
    if f.role == "rollout":
        run_rollout(config, f.workdir)
    elif f.role == "trainer":
        run_trainer(config, f.workdir)
    else:
        procs = [subprocess.Popen(cmd) for cmd in role_commands(sys.argv)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a process failed: exit codes {dict(zip(ROLES, codes, strict=True))}")


def define_flags() -> None:
    harness.define_config_flag("tiny_cpu")
    flags.DEFINE_string("workdir", "workdir/disaggregated", "shared by the two processes")
    flags.DEFINE_enum("role", "both", ["rollout", "trainer", "both"], "which process this is")
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
