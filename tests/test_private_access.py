"""No module of ``training/`` reaches into another module's private attributes.

A collaborator's state is read and changed through its own methods and public attributes; a
``_name`` belongs to the module that defines it. Read from the source (``ast``): for each
``expr._name`` outside ``self``/``cls``, and each ``from fsdp_mem_otel... import _name``, the name
must not be one that another module of ``training/`` defines (a private function, class or
module-level name, or an attribute it sets on ``self``); no private name is imported from the
package. Private names of other libraries (``torch._C``, FSDP's ``_training_state`` in the
adapters, the one place that may touch them) are not the package's and pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fsdp_mem_otel

PACKAGE = Path(fsdp_mem_otel.__file__).parent
CHECKED = PACKAGE / "training"


def _private_names(tree: ast.AST) -> set[str]:
    """The private names a module gives its objects and itself: attributes set on
    ``self``/``cls``, methods and class-level names, ``__slots__`` entries, and its module-level
    functions, classes and names."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            names.update(c.value for c in ast.walk(node.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    for node in getattr(tree, "body", []):  # module level, and each class's own level
        for inner in [node, *(node.body if isinstance(node, ast.ClassDef) else [])]:
            targets = inner.targets if isinstance(inner, ast.Assign) else \
                [inner.target] if isinstance(inner, ast.AnnAssign) else []
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _definers(root: Path) -> dict[str, set[Path]]:
    out: dict[str, set[Path]] = {}
    for path in root.rglob("*.py"):
        for name in _private_names(ast.parse(path.read_text())):
            out.setdefault(name, set()).add(path)
    return out


def cross_module_private_access(root: Path = CHECKED, defined_in: Path = CHECKED) -> list[str]:
    """``path:line: what`` for each access in ``root`` to a private name that another module of
    ``root`` or ``defined_in`` defines."""
    definers = _definers(root)
    for name, paths in _definers(defined_in).items():
        definers.setdefault(name, set()).update(paths)
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                others = definers.get(node.attr, set()) - {path}
                if others:
                    found.append(f"{rel}:{node.lineno}: .{node.attr} (a private name of "
                                 f"{', '.join(sorted(o.parent.name + '/' + o.name for o in others))})")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_mem_otel"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{rel}:{node.lineno}: import {node.module}.{alias.name}")
    return found


def test_no_module_in_training_reaches_into_another_modules_private_attributes() -> None:
    assert cross_module_private_access() == []


def test_the_check_finds_a_reach_in(tmp_path: Path) -> None:
    # the rule itself: a module that reads another's private attribute, and one that imports a
    # private name, are found; its own private names and another library's pass
    (tmp_path / "reader.py").write_text(
        "from fsdp_mem_otel.training.light.counters import _N\n"
        "import torch\n"
        "def read(ledger, t):\n"
        "    _own = 1\n"
        "    return ledger._flushing, t._version, torch._C, _own\n"
    )
    found = cross_module_private_access(tmp_path)
    assert [f.split(":", 2)[2].split(" (")[0].strip() for f in found] == [
        "import fsdp_mem_otel.training.light.counters._N", "._flushing"]
