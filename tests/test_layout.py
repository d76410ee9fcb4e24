"""The package's layout: five parts and the shared vocabulary, imports only downwards and in no
circle, short classes.

Read from the source (``ast``), not from the modules' behaviour: which part each module belongs to
is its folder; what it imports is every ``import``/``from`` statement in it, at any depth.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import fsdp_mem_otel

PACKAGE = Path(fsdp_mem_otel.__file__).parent
ROOT = PACKAGE.parent
SHARED = {"schema", "config", "env", "checks", "failures", "identity", "cli_errors"}
PARTS = {"training", "tools", "exporters", "fleet", "offline"}
#: entry points that wire the parts together, and the package's own plumbing
ENTRY = {"__init__", "__main__", "cli", "_moved", "integrations", "run", "bootstrap"}
#: part -> the parts (besides itself and the shared vocabulary) it may import
MAY_IMPORT = {
    "shared": set(),
    "fleet": set(),
    "offline": set(),
    "exporters": {"fleet", "offline"},
    "training": {"exporters", "fleet", "offline"},  # never tools: they are built on it
    "tools": {"training", "exporters", "fleet", "offline"},
}
TORCH_FREE = ("shared", "fleet", "offline", "exporters")


def _part(module: str) -> str:
    """``fsdp_mem_otel.fleet.serve`` -> "fleet"; shared modules -> "shared"; entry points -> "entry"."""
    head = module.split(".")[1] if "." in module else "__init__"
    if head in PARTS:
        return head
    return "shared" if head in SHARED else "entry"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("fsdp_mem_otel.") and m.split(".")[1] not in {"__version__"}}


def _import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, by every ``import``/``from`` statement at any
    depth (inside functions and ``if TYPE_CHECKING:`` too; relative ones resolved). An import
    names the most specific module it reaches (``from a.b import c``: ``a.b.c`` if a module, else
    ``a.b``); the parent packages Python initializes on the way are not edges (they run first
    whoever imports a submodule, so they would close a circle with every ``__init__`` that
    imports its own submodules)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names.extend(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        targets = set()
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        if v not in seen:
            seen.add(v)
            todo.extend(graph[v])
    return False


#: import edges (importer, imported) left out of the circle check, each with why. The package root
#: re-exports FSDPMemoryTracker lazily (``__getattr__``, PEP 562, and under TYPE_CHECKING), never
#: while it is imported, and its submodules read names it defines before any of that:
#: training/tracker.py ``MISSING_TORCH``, exporters/otel.py and exporters/prometheus.py
#: ``__version__`` (tracker -> exporters -> otel, prometheus -> the root -> tracker). To drop the
#: exemption, move those two names to a shared module the three import instead of the root.
CIRCLE_EXEMPT = {
    ("fsdp_mem_otel", "fsdp_mem_otel.training.tracker"): "the root's lazy re-export of FSDPMemoryTracker",
}


def test_no_import_circle() -> None:
    graph = _import_graph()
    assert graph["fsdp_mem_otel.tools.estimate_fit"] >= {"fsdp_mem_otel.tools.estimate"}  # the graph sees imports
    for importer, imported in CIRCLE_EXEMPT:
        assert imported in graph[importer] and _reaches(graph, imported, importer), (
            f"{importer} -> {imported} no longer closes a circle: remove it from CIRCLE_EXEMPT")
        graph[importer] = graph[importer] - {imported}
    circles = [f"{' <-> '.join(c)}: " + "; ".join(f"{m} imports {', '.join(sorted(graph[m] & set(c)))}" for m in c)
               for c in _circles(graph)]
    assert circles == []


def test_the_top_level_holds_the_parts_the_shared_vocabulary_and_entry_points() -> None:
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir())}
    assert names == SHARED | PARTS | ENTRY


def test_imports_run_only_downwards() -> None:
    modules = _modules()
    wrong = []
    for module, path in sorted(modules.items()):
        part = _part(module)
        if part == "entry":
            continue
        allowed = {part, "shared"} | MAY_IMPORT[part]
        for imported in sorted(_imports(path)):
            target = next((m for m in (imported, imported.rsplit(".", 1)[0]) if m in modules), None)
            if target is not None and _part(target) not in allowed and target != "fsdp_mem_otel":
                wrong.append(f"{module} ({part}) imports {target} ({_part(target)})")
    assert wrong == []


def test_no_class_is_long_and_the_tracker_is_short() -> None:
    sizes = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    assert {k: v for k, v in sizes.items() if v > 300} == {}
    assert sizes["training/tracker.py:FSDPMemoryTracker"] <= 265


def test_the_torch_free_parts_import_without_torch() -> None:
    modules = sorted(m for m in _modules() if _part(m) in TORCH_FREE)
    code = textwrap.dedent(f"""
        import importlib, sys
        sys.modules["torch"] = None  # as in the slim sidecar image: importing torch fails
        for name in {modules!r}:
            importlib.import_module(name)
        print(len({modules!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == len(modules) > 20


def test_public_imports_and_old_module_paths_keep_working() -> None:
    code = textwrap.dedent("""
        from fsdp_mem_otel import FSDPMemoryTracker, StepReport, TrackerConfig
        from fsdp_mem_otel.integrations.hf import FSDPMemoryCallback
        import fsdp_mem_otel.tracker, fsdp_mem_otel.training.tracker
        from fsdp_mem_otel.adapters.fsdp2 import FSDP2Adapter
        from fsdp_mem_otel.estimate import EstimateConfig
        import fsdp_mem_otel.tools.estimate, fsdp_mem_otel.tools.demo, fsdp_mem_otel.tools.estimate_fit
        import fsdp_mem_otel.training.estimate, fsdp_mem_otel.training.demo, fsdp_mem_otel.training.estimate_fit
        from fsdp_mem_otel.training.demo import BlockModel
        from fsdp_mem_otel.training import estimate_fit
        assert fsdp_mem_otel.tracker is fsdp_mem_otel.training.tracker
        assert EstimateConfig is fsdp_mem_otel.tools.estimate.EstimateConfig
        assert fsdp_mem_otel.training.estimate is fsdp_mem_otel.tools.estimate
        assert fsdp_mem_otel.training.demo is fsdp_mem_otel.tools.demo
        assert estimate_fit is fsdp_mem_otel.tools.estimate_fit
        assert BlockModel is fsdp_mem_otel.tools.demo.BlockModel
        assert FSDPMemoryTracker is fsdp_mem_otel.training.tracker.FSDPMemoryTracker
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for argv in (["-m", "fsdp_mem_otel", "report", "--help"], ["-m", "fsdp_mem_otel.report", "--help"],
                 ["-m", "fsdp_mem_otel.offline.report", "--help"], ["-m", "fsdp_mem_otel.training.demo", "--help"]):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0 and "usage:" in out.stdout, (argv, out.stderr)
