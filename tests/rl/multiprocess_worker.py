"""One process of `test_multiprocess.py`'s run: the RL entry point `experiments.main` (its flags:
the config, `--coordinator`, `--num_processes`, `--process_id`), scoring responses with
`ParityVerifier` so that an untrained policy earns rewards.

  python -m tests.rl.multiprocess_worker --config=configs/tiny_cpu.py --workdir=... \\
      --coordinator=127.0.0.1:<port> --num_processes=2 --process_id=<i>
"""

from __future__ import annotations

from absl import app

from trace_jax import tasks
from trace_jax.data import Example


class ParityVerifier:
    """Correct when the question's length and the response's character codes sum to an even
    number: about half the samples of any policy, also within a group (so advantages are not
    all zero), and a function of each row's own problem (so a response scored against another
    row's problem changes the reward)."""

    def score(self, example: Example, response: str | None) -> tasks.Score:
        correct = (len(example.question) + sum(map(ord, response or ""))) % 2 == 0
        return tasks.Score(answer=response, well_formed=True, correct=correct)


def parity_verifier(_task_config) -> ParityVerifier:
    """A stand-in for `TaskConfig.make_verifier`."""
    return ParityVerifier()


if __name__ == "__main__":
    from experiments import main as rl_main
    from trace_jax.rl.experiment import TaskConfig

    TaskConfig.make_verifier = parity_verifier
    rl_main.define_flags()
    app.run(rl_main.main)
