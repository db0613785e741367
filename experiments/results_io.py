"""One writer for experiment results: JSON (rows + metadata), a markdown table, provenance."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


GPU_STATE_QUERY = ("clocks.sm", "clocks.max.sm", "clocks.mem", "temperature.gpu", "power.draw")


def gpu_state() -> dict[str, str] | None:
    """The first GPU's SM / memory clocks, temperature and power as `nvidia-smi` reports them
    now, or None without one. Written beside timings because a hot GPU's lower SM clock slows
    instruction-bound kernels while bandwidth-bound ones keep their speed (kernels_findings
    item 13)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--id=0", f"--query-gpu={','.join(GPU_STATE_QUERY)}",
             "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in out.strip().splitlines()[0].split(",")] if out.strip() else []
    return dict(zip(GPU_STATE_QUERY, values, strict=True)) if len(values) == 5 else None


def provenance() -> dict[str, Any]:
    """Date, device and the exact command that produced a result; on a GPU, its clocks,
    temperature and power when the result was written (`gpu_state`)."""
    dev = jax.devices()[0]
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{dev.platform}: {getattr(dev, 'device_kind', str(dev))} x{jax.device_count()}",
        "command": "python -m " + " ".join([_module_name(), *sys.argv[1:]]),
        "jax": jax.__version__,
        "host": platform.machine(),
    }
    if dev.platform == "gpu" and (state := gpu_state()) is not None:
        meta["gpu_state_at_write"] = state
    return meta


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else os.path.basename(sys.argv[0])


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], fmt: str = ".4g") -> str:
    """A markdown table of `columns` from `rows`; floats formatted with `fmt`, cells a row does
    not have shown as "n/a"."""

    def cell(v: Any) -> str:
        return format(v, fmt) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "n/a")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(
    name: str,
    rows: list[dict[str, Any]],
    *,
    title: str,
    table: str,
    notes: str = "",
    outdir: str = RESULTS_DIR,
    extra: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Writes `<outdir>/<name>.json` and `.md`; returns their paths."""
    os.makedirs(outdir, exist_ok=True)
    meta = provenance()
    payload = {"meta": meta, "rows": rows, **(extra or {})}
    json_path = os.path.join(outdir, f"{name}.json")
    md_path = os.path.join(outdir, f"{name}.md")
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=1)
    header = (
        f"# {title}\n\n"
        f"- Regenerate: `{meta['command']}`\n"
        f"- Date: {meta['date']}; device: {meta['device']}; jax {meta['jax']}\n"
    )
    if state := meta.get("gpu_state_at_write"):
        header += "- GPU when written: " + ", ".join(f"{k} {v}" for k, v in state.items()) + "\n"
    header += "\n"
    with open(md_path, "w") as f:
        f.write(header + table + "\n" + (f"\n{notes}\n" if notes else ""))
    return {"json": json_path, "md": md_path}


def rows_written_by(path: str, producer: str, required: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a result JSON written by `producer` (a module name, for the error), checked
    to carry the `required` keys in every row; a clear ValueError otherwise."""
    with open(path) as f:
        rows = json.load(f).get("rows")
    missing = sorted({k for r in rows or [{}] for k in required if k not in r})
    if not rows or missing:
        raise ValueError(f"{path} is not a result written by {producer} (rows lack {missing})")
    return rows
