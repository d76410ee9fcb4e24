"""fsdp_mem_otel: always-on per-module memory tracking for PyTorch FSDP, exported to Prometheus and OTel.

Public API: FSDPMemoryTracker, TrackerConfig, StepReport, ModuleReport and the CATEGORIES / STATES
vocabularies. Importing the package does not import torch; the tracker does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.schema import CATEGORIES, CATEGORY_KEYS, STATES, ModuleReport, StepReport

if TYPE_CHECKING:
    from fsdp_mem_otel.tracker import FSDPMemoryTracker

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


def __getattr__(name: str) -> Any:
    if name == "FSDPMemoryTracker":
        from fsdp_mem_otel.tracker import FSDPMemoryTracker

        return FSDPMemoryTracker
    raise AttributeError(name)


#: what importing the tracker says where torch is missing (a slim sidecar install)
MISSING_TORCH = (
    "the fsdp_mem_otel tracker needs PyTorch 2.13 or 2.14: install it pinned first (e.g. pip install "
    "torch==2.13.0), or pip install 'fsdp-mem-otel[torch]'. Without it only the sidecar, report, rules and "
    "dashboards commands work."
)
