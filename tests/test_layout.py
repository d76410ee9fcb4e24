"""The package's layout: four parts and the shared vocabulary, imports only downwards, short classes.

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
SHARED = {"schema", "config", "env", "checks", "failures", "identity"}
PARTS = {"training", "exporters", "fleet", "offline"}
#: entry points that wire the parts together, and the package's own plumbing
ENTRY = {"__init__", "__main__", "cli", "_moved", "integrations", "run", "bootstrap"}
#: part -> the parts (besides itself and the shared vocabulary) it may import
MAY_IMPORT = {
    "shared": set(),
    "fleet": set(),
    "offline": set(),
    "exporters": {"fleet", "offline"},
    "training": {"exporters", "fleet", "offline"},
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
        assert fsdp_mem_otel.tracker is fsdp_mem_otel.training.tracker
        assert FSDPMemoryTracker is fsdp_mem_otel.training.tracker.FSDPMemoryTracker
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for argv in (["-m", "fsdp_mem_otel", "report", "--help"], ["-m", "fsdp_mem_otel.report", "--help"],
                 ["-m", "fsdp_mem_otel.offline.report", "--help"]):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0 and "usage:" in out.stdout, (argv, out.stderr)
