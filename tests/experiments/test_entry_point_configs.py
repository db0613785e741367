"""The entry points: every one imports no other `experiments` module than the harness and no
private names. The benchmark and analysis ones are each their config file plus overrides: every
config builds with all its defaults, its smoke variant only changes values, its docstring gives
the launch commands; and `--config` overrides reach a run from the command line."""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
ENTRY_POINTS = [
    "bench_quantize",
    "bench_decode_attention",
    "bench_moe_matmul",
    "bench_decode_step",
    "decode_attention_ablation",
    "quantize_ablation",
    "profile_kernels",
    "platform_numerics",
    "mismatch_analysis",
    "bench_guidance_store",
    "rollout_throughput",
    "moe_matmul_ablation",
    "hf_load_memory",
    "bandwidth_ceilings",
    "multi_gpu",
]
WITHOUT_SMOKE_VARIANT = {"mismatch_analysis", "bench_guidance_store"}
# Every module of experiments/ but the shared harness.
ALL_ENTRY_POINTS = sorted(
    p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem not in ("__init__", "harness")
)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_config_holds_every_default_and_names_its_entry_point(name):
    module = importlib.import_module(f"configs.{name}")
    assert f"python -m experiments.{name}" in module.__doc__
    config = module.get_config()
    assert len(config) > 0
    if name in WITHOUT_SMOKE_VARIANT:
        return
    smoke = module.get_config("smoke")
    assert smoke.smoke and not config.smoke
    # A variant changes values, never the fields (overrides stay valid for both).
    assert sorted(smoke.to_dict()) == sorted(config.to_dict())
    assert smoke.to_dict() != {**config.to_dict(), "smoke": True}
    with pytest.raises(ValueError, match="unknown config variant 'large'"):
        module.get_config("large")


def test_every_config_entry_point_is_an_entry_point():
    assert set(ENTRY_POINTS) < set(ALL_ENTRY_POINTS) and "paper_table" in ALL_ENTRY_POINTS


@pytest.mark.parametrize("name", ALL_ENTRY_POINTS)
def test_entry_point_imports_only_the_shared_helpers_and_public_names(name):
    tree = ast.parse((ROOT / "experiments" / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            assert not any(n.startswith("_") and n != "__future__" for n in names), names
            if node.module == "experiments":  # the shared helpers only
                assert set(names) <= {"harness", "timing"}, names
            assert not (node.module or "").startswith("experiments."), node.module
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("experiments.") for a in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            # a private name of a module, e.g. `kernel._private_helper`
            assert not node.attr.startswith("_") or node.attr.startswith("__"), node.attr


def test_overrides_reach_the_run_from_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "experiments.bench_guidance_store", "--config.model.preset=tiny",
           "--config.rows=4", "--config.tokens=6", "--config.steps=1", f"--outdir={tmp_path}",
           "--name=gs"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    saved = json.loads((tmp_path / "gs.json").read_text())
    assert [(r["preset"], r["rows"], r["tokens"]) for r in saved["rows"]] == [("tiny", 4, 6)] * 2
    assert "--config.rows=4" in saved["meta"]["command"]
    bad = [*cmd[:3], "--config.row=4"]  # locked: only fields the file defines
    result = subprocess.run(bad, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and 'Did you mean "rows" instead of "row"' in result.stderr
