"""One-way layering of `trace_jax` and `kernels_pallas`, read from the source (ast, every import
statement: module top level and inside functions alike).

  (a) kernels depend on the numerics core only: `kernels_pallas` imports nothing from `trace_jax`
      but `trace_jax.fp4` and its submodules;
  (b) the core, `trace_jax.fp4`, imports nothing else from the project, and neither does
      `trace_jax/__init__.py`, which runs first whenever the core is imported;
  (c) no import cycle between files (strongly connected components of the import graph);
  (d) `trace_jax` reaches kernels through their op interfaces (`kernels_pallas.<op>`, its `api`,
      and `kernels_pallas.common` for the `Implementation` type), imported at module top level.

An import `from a.b import c` is an edge to the module `a.b.c` where that is a file of the project,
else to `a.b` (whose `__init__.py` defines `c`). The implicit import of parent packages is not an
edge: every submodule of a package whose `__init__.py` re-exports it would be a cycle otherwise.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trace_jax", "kernels_pallas")
CORE = "trace_jax.fp4"


@dataclasses.dataclass(frozen=True)
class Edge:
    """`source` imports `target` (module names) at `line`, inside a function or class if not
    `top_level`."""

    source: str
    target: str
    line: int
    top_level: bool

    def __str__(self) -> str:
        where = "" if self.top_level else " (deferred)"
        return f"{self.source} -> {self.target} (line {self.line}){where}"


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file of every module under `root`'s PACKAGES (a package is its
    `__init__.py`)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted `name` that is a project module, or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in modules:
            return prefix
    return None


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of a module, with whether it sits at the module's top level."""
    top = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` / `try:` blocks at top level count as top level
        if isinstance(node, ast.If | ast.Try):
            top.update(id(n) for n in ast.walk(node))
    return [
        (node, id(node) in top)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]


def import_edges(root: Path) -> list[Edge]:
    """Every import between project modules under `root`."""
    modules = module_files(root)
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node, top_level in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, `level - 1` packages up
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, *([base] if base else [])])
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                module = _project_module(target, modules)
                if module is not None and module != name:
                    edges.append(Edge(name, module, node.lineno, top_level))
    return edges


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def kernel_violations(edges: list[Edge]) -> list[Edge]:
    """(a): imports of `kernels_pallas` into `trace_jax` outside the core."""
    kernels_to_trace_jax = [
        e for e in edges if _in(e.source, "kernels_pallas") and _in(e.target, "trace_jax")
    ]
    return [e for e in kernels_to_trace_jax if not _in(e.target, CORE)]


def core_violations(edges: list[Edge]) -> list[Edge]:
    """(b): imports of the core (or of `trace_jax/__init__.py`) from the rest of the project."""
    return [
        e
        for e in edges
        if (_in(e.source, CORE) or e.source == "trace_jax") and not _in(e.target, CORE)
    ]


def cycles(edges: list[Edge]) -> list[list[str]]:
    """(c): the import graph's strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:  # recursion depth is bounded by the project's ~100 modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def op_interface_violations(edges: list[Edge]) -> list[Edge]:
    """(d): imports of `kernels_pallas` into `trace_jax` that are deferred or that reach past an
    op's interface (its `kernel.py` or `reference.py`)."""
    bad = []
    for e in edges:
        if not (_in(e.source, "trace_jax") and _in(e.target, "kernels_pallas")):
            continue
        parts = e.target.split(".")
        interface = e.target == "kernels_pallas.common" or (
            len(parts) == 2 or (len(parts) == 3 and parts[2] == "api")
        )
        if not (interface and e.top_level):
            bad.append(e)
    return bad


def test_the_graph_sees_the_projects_imports():
    """The parser finds known edges (top level and deferred), so an empty violation list means
    something: the checks below cannot pass on a graph that misses imports."""
    edges = import_edges(ROOT)
    pairs = {(e.source, e.target) for e in edges}
    assert ("kernels_pallas.fp4_quantize.api", "kernels_pallas.common") in pairs
    assert ("kernels_pallas.fp4_quantize.api", "trace_jax.fp4") in pairs
    assert ("trace_jax.fp4.quantize", "trace_jax.fp4.numerics") in pairs  # from package import mod
    assert ("trace_jax.models.attention", "kernels_pallas.fp4_decode_attention") in pairs
    assert ("trace_jax", "trace_jax.fp4") not in pairs  # implicit parents are not edges
    assert len(module_files(ROOT)) > 50


def test_kernels_import_only_the_numerics_core():
    assert [str(e) for e in kernel_violations(import_edges(ROOT))] == []


def test_the_core_imports_nothing_else_from_the_project():
    assert [str(e) for e in core_violations(import_edges(ROOT))] == []


def test_no_import_cycle_between_files():
    assert cycles(import_edges(ROOT)) == []


def test_the_model_reaches_kernels_through_op_interfaces_at_top_level():
    assert [str(e) for e in op_interface_violations(import_edges(ROOT))] == []


def test_checks_catch_each_violation(tmp_path):
    """Each check fails on a small tree that breaks its rule (and only that rule's check)."""
    files = {
        "trace_jax/__init__.py": "",
        "trace_jax/fp4/__init__.py": "from trace_jax.fp4 import core\n",
        "trace_jax/fp4/core.py": "import numpy\n",
        "trace_jax/models/__init__.py": "",
        "trace_jax/models/cache.py": "from trace_jax.fp4 import core\n",
        "trace_jax/models/attention.py": (
            "from trace_jax.models import cache\ndef f():\n    from kernels_pallas.op import run\n"
        ),
        "kernels_pallas/__init__.py": "",
        "kernels_pallas/op/__init__.py": "from .api import run\n",
        "kernels_pallas/op/api.py": "from trace_jax.models.cache import C\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = import_edges(tmp_path)
    assert [str(e) for e in kernel_violations(edges)] == [
        "kernels_pallas.op.api -> trace_jax.models.cache (line 1)"
    ]
    assert core_violations(edges) == []
    assert cycles(edges) == []
    assert [str(e) for e in op_interface_violations(edges)] == [
        "trace_jax.models.attention -> kernels_pallas.op (line 3) (deferred)"
    ]
    (tmp_path / "trace_jax/fp4/core.py").write_text("from trace_jax.models import C\n")
    edges = import_edges(tmp_path)
    assert [str(e) for e in core_violations(edges)] == [
        "trace_jax.fp4.core -> trace_jax.models (line 1)"
    ]
    # models (package) -> models.cache -> fp4.core -> models: one cycle of three modules.
    (tmp_path / "trace_jax/models/__init__.py").write_text("from trace_jax.models.cache import C\n")
    assert cycles(import_edges(tmp_path)) == [
        ["trace_jax.fp4.core", "trace_jax.models", "trace_jax.models.cache"]
    ]
