"""Module peaks and call counts of a StepReport, read without building its snapshot dicts.

The tracker hands reports over with ``CountedModuleReport`` modules, each with its forward and
backward peak totals computed by the recorder at the step's end (``peak_totals``, read first here:
two integers instead of a walk over the counters on an exporter's cold thread); their snapshots stay the
recorder's counters (``schema.device_counters``) until ``snapshots`` is first read, which then builds a dict of 12
categories per device, state and call for that module (about 1,000 dicts per step at 100 FSDP
modules, 2.5-7 ms of CPU on a 2-core machine). An exporter that only needs a module's peak total,
or whether and how often a state was reached, reads them here from the counters instead, and the
dicts are built only for what is written out in full (a JSONL line that carries the snapshots,
module spans, Prometheus detail series). Same answers as ``ModuleReport.peak_total`` and
``snapshots`` (``tests/exporters/test_peaks.py``); a module whose dicts exist, or a plain
``ModuleReport``, is read through them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from fsdp_mem_otel.schema import PEAK_BACKWARD, PEAK_FORWARD, CountedModuleReport, ModuleReport, largest_total

#: state -> one snapshot's counters per call (``schema.device_counters``)
_Counters = dict[str, list[Any]]


def _counters(mod: ModuleReport) -> _Counters | None:
    """The module's counters while its snapshot dicts are not built, else None."""
    return mod.counters if isinstance(mod, CountedModuleReport) else None


def peaks(mod: ModuleReport) -> tuple[int | None, int | None]:
    """``peak_total`` of ``peak_forward`` and of ``peak_backward`` in one call, each None when the
    module has no snapshot of that state (for the paths that run every step)."""
    if isinstance(mod, CountedModuleReport) and mod.peak_totals is not None:
        return mod.peak_totals  # the recorder's, from the training thread
    raw = _counters(mod)
    if raw is not None:
        fwd_calls, bwd_calls = raw.get(PEAK_FORWARD), raw.get(PEAK_BACKWARD)
        return (largest_total(fwd_calls) if fwd_calls else None), (largest_total(bwd_calls) if bwd_calls else None)
    snapshots = mod.snapshots
    return (mod.peak_total(PEAK_FORWARD) if snapshots.get(PEAK_FORWARD) else None,
            mod.peak_total(PEAK_BACKWARD) if snapshots.get(PEAK_BACKWARD) else None)


def module_peaks(modules: Mapping[str, ModuleReport]) -> Iterator[tuple[str, int, int]]:
    """(key, forward peak, backward peak) of each module, 0 for a state it did not reach: ``peaks``
    in one loop, for the JSONL writer's check of every line."""
    for key, mod in modules.items():
        if isinstance(mod, CountedModuleReport):
            given = mod.peak_totals
            if given is not None:
                yield key, given[0] or 0, given[1] or 0
                continue
            raw = mod.counters
        else:
            raw = None
        if raw is not None:
            calls = raw.get(PEAK_FORWARD)
            fwd = largest_total(calls) if calls else 0
            calls = raw.get(PEAK_BACKWARD)
            yield key, fwd, largest_total(calls) if calls else 0
        else:
            yield key, mod.peak_total(PEAK_FORWARD), mod.peak_total(PEAK_BACKWARD)


def all_calls(modules: Mapping[str, ModuleReport]) -> int:
    """How many snapshots ``modules`` hold (every module, state and call)."""
    n = 0
    for mod in modules.values():
        n += mod.calls if isinstance(mod, CountedModuleReport) else sum(map(len, mod.snapshots.values()))
    return n
