"""Listing and garbage collection of guidance entries: consumed steps (`collect`) and the steps a
resumed run samples again (`discard_from`), each one key-range delete."""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import tensorstore as ts

from trace_jax.guidance import layout
from trace_jax.guidance.kvstore import Kv, kv_call

_MANIFEST_RE = re.compile(r"step_(\d{10})/mb_(\d{5})/" + re.escape(layout.MANIFEST) + "$")


class GarbageCollector:
    """Lists and deletes the entries of a run. Thread-safe."""

    def __init__(self, kv: Kv):
        self._kv = kv

    def entries(self, run: str) -> list[tuple[int, int]]:
        """Committed entries of `run` as sorted (step, micro_batch) pairs."""
        prefix = f"{layout.check_run(run)}/step_"
        keys = kv_call(
            self._kv.store.list(
                ts.KvStore.KeyRange(prefix, layout.prefix_range_end(prefix)),
                strip_prefix_length=len(run) + 1,
            ),
            run,
        )
        found = (_MANIFEST_RE.fullmatch(k.decode()) for k in keys)
        return sorted((int(m[1]), int(m[2])) for m in found if m)

    def collect(self, run: str, up_to_step: int) -> list[tuple[int, int]]:
        """Deletes every entry of `run` with step <= `up_to_step` (consumed); returns them.

        Later steps and the published policy version are kept. Also removes uncommitted data of
        those steps (e.g. from a writer that died before committing).
        """
        if up_to_step < 0:
            return []
        removed = [e for e in self.entries(run) if e[0] <= up_to_step]
        lo = f"{run}/step_"
        # Step numbers are zero-padded, so "steps <= up_to_step" is the key range [lo, hi).
        hi = layout.step_prefix(run, up_to_step + 1) if up_to_step < layout.MAX_STEP else None
        kv_call(
            self._kv.store.delete_range(ts.KvStore.KeyRange(lo, hi or layout.prefix_range_end(lo))),
            run,
        )
        self._remove_empty_dirs(run, lambda s: s <= up_to_step)
        return removed

    def discard_from(self, run: str, step: int) -> list[tuple[int, int]]:
        """Deletes every entry of `run` with step >= `step` (committed or not); returns them.

        For a run resumed from its checkpoint at `step - 1`: an interrupted attempt may have
        committed guidance for steps it never trained, and the resumed run samples them again.
        (Only for a run whose rollout and trainer restart together; a separate rollout worker's
        entries ahead of the trainer are live.)
        """
        lo = layout.step_prefix(run, step)
        end = layout.prefix_range_end(f"{run}/step_")
        removed = [e for e in self.entries(run) if e[0] >= step]
        kv_call(self._kv.store.delete_range(ts.KvStore.KeyRange(lo, end)), run)
        self._remove_empty_dirs(run, lambda s: s >= step)
        return removed

    def _remove_empty_dirs(self, run: str, collected: Callable[[int], bool]) -> None:
        """Removes the empty directories of steps `collected(step)` (file kvstore only)."""
        root = self._kv.file_root()
        run_dir = os.path.join(root, run) if root else None
        if run_dir is None or not os.path.isdir(run_dir):
            return
        for name in os.listdir(run_dir):
            step = name.removeprefix("step_")
            if name.startswith("step_") and step.isdigit() and collected(int(step)):
                self._kv.prune_dirs(f"{run}/{name}/")
