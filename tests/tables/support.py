"""What the table tests share: a tiny table config, stand-ins for the scorer and the RL loop,
and run logs written by hand (aggregation reads logs only, so most table tests need no
training)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from tests import tiny
from tests.rl.rollouts import LOOP_LAYERS
from trace_jax.tables.grid import run_dir, table_section
from trace_jax.tables.step_time import PHASES

# The xdist group of the tests that share the trained tiny table (one worker trains it).
TRAINED_TABLE = "trained_tiny_table"


def table_config():
    """A 1-block `tiny` table: `bf16` and `trace` runs, seeds 0 and 1, 3 GRPO steps in chunks
    of 2, evaluated every step, on the shapes of the RL loop's own tests."""
    cd = tiny.experiment_config()
    cd.model.n_layers = LOOP_LAYERS
    cd.sft.update(steps=4, batch_size=4, log_every=2, warmup_steps=1)
    cd.eval.update(splits=("level1", "arith_countdown_l2"), problems_per_split=2, max_new_tokens=8)
    cd.rl.update(
        steps=3, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_every=1,
        checkpoint_every=1, learning_rate=1e-2, mismatch_every=0,
    )  # fmt: skip
    cd.table = table_section(
        name="t",
        title="test table",
        seeds=(0, 1),
        runs=(("bf16", {"rl.method": "bf16"}), ("trace", {"rl.method": "trace"})),
        chunk_steps=2,
    )
    return cd


def fake_pass_at_1(model, problems, key, **kw) -> float:
    """A stand-in pass@1 that differs between policies (a function of the weights), so means and
    stds over seeds are tested on distinct numbers; tiny policies score 0 for real."""
    del key, kw
    leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    return float(np.abs(np.asarray(leaf, np.float64)).sum() * 1e3 % 1.0) + 0.001 * len(problems)


def write_jsonl(path, rows: Sequence[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def write_run_logs(workdir, label: str, seed: int, evals: Sequence[dict], metrics=()) -> str:
    """`rl_eval.jsonl` (and `rl_metrics.jsonl`) of one run as the RL loop writes them; returns
    the run directory."""
    d = run_dir(str(workdir), label, seed)
    write_jsonl(os.path.join(d, "rl_eval.jsonl"), evals)
    write_jsonl(os.path.join(d, "rl_metrics.jsonl"), metrics)
    return d


def write_sft_eval(workdir, scores: dict[str, dict[str, float]]) -> None:
    """`<workdir>/sft/sft_eval.json`: `scores` maps execution ("bf16", "nvfp4") -> split ->
    pass@1."""
    splits = list(next(iter(scores.values())))
    rows = [
        {"split": s, "problems": 2, **{f"pass@1_{e}": v[s] for e, v in scores.items()}}
        for s in splits
    ]
    os.makedirs(os.path.join(workdir, "sft"), exist_ok=True)
    with open(os.path.join(workdir, "sft", "sft_eval.json"), "w") as f:
        json.dump({"rows": rows}, f)


def fake_loop(times: dict[str, list[tuple[float, float, float]]]):
    """Stands in for `RLLoop`: logs the given (rollout, guidance I/O, train) seconds per step."""

    class FakeLoop:
        def __init__(self, config, workdir):
            rl = config.rl
            assert rl.eval_every == 0 and rl.mismatch_every == 0 and not rl.init_from
            assert rl.checkpoint_every == rl.steps
            self.config, self.workdir = config, workdir

        def run(self, before_step=None):
            os.makedirs(self.workdir, exist_ok=True)
            rl = self.config.rl
            with open(os.path.join(self.workdir, "rl_metrics.jsonl"), "w") as f:
                for step, t in enumerate(times[rl.method][: rl.steps]):
                    if before_step is not None:
                        before_step(step)
                    row = dict(zip(PHASES, t, strict=True))
                    row["time_guidance_write_s"] = 0.25 * t[1]
                    row["time_guidance_read_s"] = 0.75 * t[1]
                    f.write(json.dumps({"step": step, "reward": 0.1 * step, **row}) + "\n")

    return FakeLoop
