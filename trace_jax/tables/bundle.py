"""What a GPU machine's table runs bring back: run logs and evaluations in one tarball.

`bundle` packs a queue root (`trace_jax.tables.queue`: `<root>/<table>/<label>/seed<k>/`, the
shared `<root>/sft/`, job logs in `<root>/logs/` and the queue's event log) without checkpoints
or guidance stores; `unpack_bundle` puts it into a results tree, one folder per table.
"""

from __future__ import annotations

import os
import tarfile

from trace_jax.rl.sft import SFT_START

# In a run directory copied from an earlier machine's results (`queue.adopt_finished`): where from.
ADOPTED_NOTE = "adopted_from.txt"
# The files of a run or SFT stage a bundle carries; never checkpoints or guidance stores.
BUNDLE_SUFFIXES = (
    "rl_metrics.jsonl",
    "rl_eval.jsonl",
    "sft_eval.json",
    "sft_metrics.jsonl",
    SFT_START,
    "same_run_as.txt",
    ADOPTED_NOTE,
)
BUNDLE_DIRS_SKIPPED = ("rl_checkpoints", "guidance", "sft_checkpoint", "tensorboard", "jax_cache")
# The job queue's event log at the root: one JSON line per job start, end, copy or skip.
EVENTS_FILE = "queue.jsonl"


def bundle(root: str, path: str) -> list[str]:
    """Writes the run logs, SFT evaluation, job logs and event log under `root` to the tarball
    `path`; returns the paths packed, relative to `root`."""
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in BUNDLE_DIRS_SKIPPED]
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if f.endswith(BUNDLE_SUFFIXES) or rel.startswith("logs/") or rel == EVENTS_FILE:
                names.append(rel)
    with tarfile.open(path, "w:gz") as tar:
        for rel in sorted(names):
            tar.add(os.path.join(root, rel), arcname=rel)
    return names


def _targets(parts: list[str], tables: list[str], dest: str, tag: str) -> list[str]:
    """Where one bundle member (its path split at "/") goes in the results tree `dest`."""
    if parts[0] in tables:  # a run's log
        return [os.path.join(dest, *parts)]
    if parts[0] == "sft":  # the shared SFT stage: beside every table's runs
        return [os.path.join(dest, t, *parts) for t in tables]
    if parts[0] == "logs":  # a job's log goes to its table, the SFT log to every table
        owner = [t for t in tables if parts[1].startswith(t + "_")] or tables
        return [os.path.join(dest, t, "logs", f"{tag}_{parts[1]}") for t in owner]
    return [os.path.join(dest, t, "logs", f"{tag}_{parts[-1]}") for t in tables]  # events


def unpack_bundle(path: str, dest: str, tag: str) -> list[str]:
    """Unpacks a bundle into `<dest>/<table name>/` (e.g. `experiments/results/runs`): each
    table's run logs, the shared SFT evaluation as that table's `sft/`, and the job logs and
    event log of its jobs under `logs/`, prefixed with `tag` (e.g. the date of the runs).

    A run the machine adopted (its `ADOPTED_NOTE`: copied from an earlier machine's results)
    brings nothing back but files `dest` lacks, never the note, which names a path on the machine.
    A run the machine trained replaces the run's files in `dest`: the queue trains a finished run
    again only when its seed's other runs start from a new SFT stage, so the older copy no longer
    pairs with them (git keeps it). An SFT record already there that differs (GPU SFT is not
    bitwise reproducible) is kept: the new one goes beside it as `sft/<tag>_<name>`, so each
    run's starting point stays on record. Returns the tables.
    """
    if not tag:
        raise ValueError("unpacking needs a tag (e.g. the date of the runs) to name its logs")
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        tables = sorted({m.name.split("/")[0] for m in members if m.name.count("/") >= 3})
        run_dirs = {tuple(m.name.split("/")[:3]) for m in members if m.name.count("/") == 3}
        adopted = {d for d in run_dirs if f"{'/'.join(d)}/{ADOPTED_NOTE}" in tar.getnames()}
        for d in run_dirs - adopted:  # trained here: the older copy's files go
            old = os.path.join(dest, *d)
            if os.path.isdir(old):
                for f in os.listdir(old):
                    if f.endswith(BUNDLE_SUFFIXES):
                        os.remove(os.path.join(old, f))
        for m in members:
            parts = m.name.split("/")
            if parts[-1] == ADOPTED_NOTE:
                continue
            data = tar.extractfile(m).read()
            for target in _targets(parts, tables, dest, tag):
                if parts[0] in tables and os.path.exists(target):
                    continue
                if parts[0] == "sft" and os.path.exists(target):
                    with open(target, "rb") as f:
                        if f.read() == data:
                            continue
                    target = os.path.join(os.path.dirname(target), f"{tag}_{parts[-1]}")
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(data)
    return tables
