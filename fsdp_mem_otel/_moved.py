"""Module paths of 0.1 kept working: ``import fsdp_mem_otel.tracker`` and ``python -m
fsdp_mem_otel.report`` find the modules where they live now (``training/``, ``tools/``, ``fleet/``,
``offline/``, ``exporters/``); so do the later ``fsdp_mem_otel.training.estimate``,
``.estimate_fit`` and ``.demo`` (now in ``tools/``). Nothing is imported until an old path is
asked for."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

_PARTS = {
    "training": ("tracker", "deep", "optimizers", "adapters", "compile_support", "allocator"),
    "training.light": ("sink", "recorder", "ledger", "activations"),
    "tools": ("estimate", "demo"),
    "exporters": ("worker",),
    "fleet": ("serve", "http_server", "rank_files", "catalog", "dashboards", "alerts", "k8s_files"),
    "offline": ("report", "run_index", "compare", "jsonl_format", "table"),
}
#: old dotted path -> where it lives now
MOVED: dict[str, str] = {f"fsdp_mem_otel.{m}": f"fsdp_mem_otel.{part}.{m}" for part, ms in _PARTS.items() for m in ms}
MOVED["fsdp_mem_otel.model"] = "fsdp_mem_otel.schema"
MOVED.update({f"fsdp_mem_otel.training.{m}": f"fsdp_mem_otel.tools.{m}" for m in ("estimate", "estimate_fit", "demo")})


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        return None  # the target ran already

    def get_code(self, fullname: str) -> Any:  # ``python -m`` runs the target's code as __main__
        spec = importlib.util.find_spec(self.target)
        assert spec is not None and spec.loader is not None
        return spec.loader.get_code(self.target)  # type: ignore[attr-defined]


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname) or next(
            (MOVED[old] + fullname[len(old):] for old in MOVED if fullname.startswith(old + ".")), None)
        spec = importlib.util.find_spec(new) if new is not None else None
        if new is None or spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new),
                                              is_package=spec.submodule_search_locations is not None)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
