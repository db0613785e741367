"""Per-step metrics of a run: one JSON line per step and TensorBoard scalars, side by side.

  with MetricsLog(workdir, "rl_metrics", append=resumed) as log:
      log.write(step, {"reward": 0.4, "loss": 1.2})

writes `<workdir>/rl_metrics.jsonl` (the record scripts read) and TensorBoard event files under
`<workdir>/tensorboard/rl_metrics` (`tensorboard --logdir <workdir>/tensorboard`). Non-numeric
values go to the JSONL only.
"""

from __future__ import annotations

import json
import numbers
import os
import uuid
from typing import Any

from tensorboardX import SummaryWriter


def read_rows(path: str, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The rows of a `.jsonl` record (one JSON object per line; blank lines skipped).
    A missing file is an error unless `missing_ok` (then no rows)."""
    if missing_ok and not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def drop_rows_from(workdir: str, name: str, step: int) -> int:
    """Removes the rows of `<workdir>/<name>.jsonl` at `step` and later; returns how many.

    A run resumed from its checkpoint at step `step - 1` repeats the steps after it: rows an
    interrupted attempt logged for them would otherwise appear twice.
    """
    path = os.path.join(workdir, f"{name}.jsonl")
    rows = read_rows(path, missing_ok=True)
    kept = [r for r in rows if r["step"] < step]
    if len(kept) < len(rows):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
    return len(rows) - len(kept)


class MetricsLog:
    """JSONL (`<workdir>/<name>.jsonl`) + TensorBoard writer for one record of a run."""

    def __init__(self, workdir: str, name: str, *, append: bool = False):
        os.makedirs(workdir, exist_ok=True)
        self.jsonl_path = os.path.join(workdir, f"{name}.jsonl")
        self._jsonl = open(self.jsonl_path, "a" if append else "w")
        # Event file names carry only the second and host: a unique suffix keeps a writer opened
        # within the same second (a resume, the next evaluation) from overwriting the last one.
        self._tb = SummaryWriter(
            logdir=os.path.join(workdir, "tensorboard", name),
            filename_suffix=f".{uuid.uuid4().hex}",
        )

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Records `metrics` at `step` (flushed at once: a killed run loses no written step)."""
        row = {"step": int(step), **metrics}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        for key, value in metrics.items():
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                self._tb.add_scalar(key, float(value), global_step=int(step))
        self._tb.flush()
        return row

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
