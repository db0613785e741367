r"""Rollout and training as separate processes, linked only by an exchange location.

  python -m experiments.disaggregated --config=configs/tiny_cpu.py --workdir=/tmp/trace_dis \
      --role=both            # or run --role=rollout and --role=trainer in two shells / hosts
  ... --config.disaggregated.lag=1   # the rollout of step t + 1 overlaps training step t
  ... --role=trainer --config.disaggregated.exchange=s3://bucket/run1/ \
      --config.disaggregated.exchange_s3_endpoint=http://minio:9000   # hosts without a shared disk

`trace_jax.rl.disaggregated` describes the handshake (policy versions, rollout batches, the
guidance store, all in the exchange: the workdir unless `disaggregated.exchange` names a kvstore
URL) and what each process writes; each keeps its log in its own `--workdir`. `--role=both`
starts the two roles as child processes of this one, with the same flags. The two watch each
other's heartbeat: when one dies, the other exits within `disaggregated.heartbeat_timeout_s`
(10 s) naming it. The runner does not resume: a workdir or exchange where a role ran before is
refused up front; `--fresh` (with `--role=both`) moves the workdir aside first.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from absl import app, flags

from experiments import harness
from trace_jax.rl.disaggregated import (
    ROLES,
    PartnerGoneError,
    WorkdirReusedError,
    refuse_reused_workdir,
    run_exchange,
    run_rollout,
    run_trainer,
)
from trace_jax.rl.exchange import Exchange
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.logs import quiet_third_party
from trace_jax.rl.workdir import move_aside

RUNNERS = {"trainer": run_trainer, "rollout": run_rollout}


def role_commands(argv: Sequence[str]) -> list[list[str]]:
    """The child processes of `--role=both`: this module with `argv`'s flags, once per role
    (`--fresh` is the parent's: it has moved the workdir aside already)."""
    own = ("--role", "--fresh", "--nofresh")
    args = [a for a in argv[1:] if not a.startswith(own)]
    cmd = [sys.executable, "-m", "experiments.disaggregated", *args]
    return [[*cmd, f"--role={role}"] for role in ROLES]


def run_both(
    argv: Sequence[str], workdir: str, *, fresh: bool = False, exchange: Exchange | None = None
) -> None:
    """Starts the two roles as child processes (`role_commands`) and waits for both, after
    refusing a workdir or `exchange` (None: the workdir) where either ran before (or moving the
    workdir aside when `fresh`): before two processes spend their start-up on it."""
    if fresh:
        move_aside(workdir)
    refuse_reused_workdir(workdir, exchange=exchange)
    procs = [subprocess.Popen(cmd) for cmd in role_commands(argv)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a process failed: exit codes {dict(zip(ROLES, codes, strict=True))}")


def main(argv):
    del argv  # flags stripped: the children get this process's command line
    f = flags.FLAGS
    quiet_third_party(f.verbose)
    if f.fresh and f.role != "both":
        raise app.UsageError(
            "--fresh needs --role=both: one role alone cannot tell whether its partner has "
            "started in the workdir already"
        )
    try:
        with harness.refusals_exit():
            config = ExperimentConfig.from_config_dict(f.config)  # refuses bad settings
            if f.role == "both":
                exchange = run_exchange(config, f.workdir)
                run_both(sys.argv, f.workdir, fresh=f.fresh, exchange=exchange)
            else:
                RUNNERS[f.role](config, f.workdir)
    except (WorkdirReusedError, PartnerGoneError) as e:  # the message says it all
        raise SystemExit(f"error ({f.role}): {e}") from None


def define_flags() -> None:
    harness.define_config_flag("tiny_cpu")
    harness.define_fresh_flag()
    flags.DEFINE_string(
        "workdir", "workdir/disaggregated", "this process's logs (and the exchange by default)"
    )
    flags.DEFINE_enum("role", "both", ["rollout", "trainer", "both"], "which process this is")
    flags.DEFINE_bool("verbose", False, "show third-party INFO logging (orbax, absl)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
