"""fsdp_mem_otel: always-on per-module memory tracking for PyTorch FSDP, exported to Prometheus and OTel.

Public API: FSDPMemoryTracker, TrackerConfig, StepReport, ModuleReport and the CATEGORIES / STATES
vocabularies. Importing the package does not import torch; the tracker does.

Layout: the shared vocabulary at the top (schema, config, env, checks, failures, identity), then
one folder per part: ``training/`` (runs inside training, needs torch), ``tools/`` (built on it:
``estimate``, its ``--fit`` search, the demo training), ``exporters/`` (reports
out to Prometheus, OpenTelemetry and JSON lines), ``fleet/`` (the sidecar, catalog, rules,
dashboards and manifests, without torch), ``offline/`` (report, compare and the JSONL readers,
without torch); ``integrations/`` and ``cli.py`` are entry points that wire them together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdp_mem_otel import _moved
from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.schema import CATEGORIES, CATEGORY_KEYS, STATES, ModuleReport, StepReport

if TYPE_CHECKING:
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

__all__ = [
    "CATEGORIES",
    "CATEGORY_KEYS",
    "STATES",
    "FSDPMemoryTracker",
    "ModuleReport",
    "StepReport",
    "TrackerConfig",
]
__version__ = "0.1.0"
_moved.install()  # 0.1's module paths (fsdp_mem_otel.tracker, ...) keep working


def __getattr__(name: str) -> Any:
    if name == "FSDPMemoryTracker":
        from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

        return FSDPMemoryTracker
    raise AttributeError(name)


#: what importing the tracker says where torch is missing (a slim sidecar install)
MISSING_TORCH = (
    "the fsdp_mem_otel tracker needs PyTorch 2.13 or 2.14: install it pinned first (e.g. pip install "
    "torch==2.13.0), or pip install 'fsdp-mem-otel[torch]'. Without it only the sidecar, report, rules and "
    "dashboards commands work."
)
