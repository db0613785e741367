"""Where the suite's time goes: a pytest plugin that records, per test, its wall time and JAX's
compile events (tracing, lowering, XLA backend compilation, and each compiled program's name and
time), and a summary of the records.

  python -m pytest -n 2 --dist loadgroup -p tests.compile_report tests   # writes the records
  python -m tests.compile_report                                       # prints the summary

Each pytest process (every xdist worker) writes `<COMPILE_REPORT_DIR>/<worker>.json` at its end
(default directory: `compile_report/` under the system's temporary directory); the summary reads
every file there. Read from `jax.monitoring`'s duration events, so compilations in subprocesses
that a test starts are not counted (their time is in the test's wall time).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

DIR_ENV = "COMPILE_REPORT_DIR"
# JAX's event names (jax._src.dispatch) -> the record's keys.
EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
}
# Backend compilations from this long are listed by name; shorter ones are only summed.
LISTED_COMPILE_S = 0.3


def report_dir() -> Path:
    return Path(os.environ.get(DIR_ENV, os.path.join(tempfile.gettempdir(), "compile_report")))


class Recorder:
    """Accumulates compile events; `records` holds one dict per finished test: `test`, `wall_s`,
    the `EVENTS` sums and `programs` ([name, seconds] of each listed compilation)."""

    def __init__(self):
        self.totals = collections.Counter()
        self.programs: list[tuple[str, float]] = []
        self.records: list[dict] = []

    def listen(self, event: str, duration: float, **kwargs) -> None:
        key = EVENTS.get(event)
        if key is None:
            return
        self.totals[key] += duration
        if key == "compile_s" and duration >= LISTED_COMPILE_S:
            self.programs.append((str(kwargs.get("fun_name", "?")), round(duration, 3)))

    def measure(self, test: str):
        """Context for one test: appends its record on exit."""
        recorder = self

        class _Measure:
            def __enter__(self):
                self.totals, self.n = dict(recorder.totals), len(recorder.programs)
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                record = {"test": test, "wall_s": round(time.perf_counter() - self.t, 3)}
                for key in EVENTS.values():
                    record[key] = round(recorder.totals[key] - self.totals.get(key, 0.0), 3)
                record["programs"] = recorder.programs[self.n :]
                recorder.records.append(record)

        return _Measure()


_RECORDER = Recorder()


def pytest_configure(config):
    # Imported here, not at the top: a `-p` plugin loads before tests/conftest.py, whose settings
    # (XLA flags, compilation cache, optimization level) must precede the first jax import.
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_RECORDER.listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _RECORDER.measure(item.nodeid):
        yield


def pytest_sessionfinish(session):
    out = report_dir()
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"{worker}.json").write_text(json.dumps(_RECORDER.records))


def summary(records: list[dict], top: int = 20) -> str:
    """The records' totals, then the files and the compiled programs that took longest."""
    total = {k: sum(r[k] for r in records) for k in ("wall_s", *EVENTS.values())}
    listed = sum(s for r in records for _, s in r["programs"])
    lines = [
        f"{len(records)} tests, {total['wall_s']:.0f} s: XLA compile {total['compile_s']:.0f} s "
        f"({listed:.0f} s in compilations of {LISTED_COMPILE_S} s or more), tracing "
        f"{total['trace_s']:.0f} s, lowering {total['lower_s']:.0f} s",
        "",
        "seconds  compile  tests  file",
    ]
    files = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in records:
        f = files[r["test"].split("::")[0]]
        f[0], f[1], f[2] = f[0] + r["wall_s"], f[1] + r["compile_s"], f[2] + 1
    for name, (wall, comp, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{wall:7.1f}  {comp:7.1f}  {n:5d}  {name}")
    lines += ["", "seconds  compilations  program"]
    programs = collections.defaultdict(lambda: [0.0, 0])
    for r in records:
        for name, seconds in r["programs"]:
            programs[name][0] += seconds
            programs[name][1] += 1
    for name, (seconds, n) in sorted(programs.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{seconds:7.1f}  {n:12d}  {name}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    directory = Path(argv[1]) if len(argv) > 1 else report_dir()
    records = [r for f in sorted(directory.glob("*.json")) for r in json.loads(f.read_text())]
    if not records:
        raise SystemExit(f"no records in {directory} (run pytest with -p tests.compile_report)")
    print(summary(records))


if __name__ == "__main__":
    main(sys.argv)
