"""Op temporaries on CUDA, from the allocator's own peak counters (``reset_peaks``, default where CUDA is). Light
mode misses what an op allocates and frees inside itself (a loss's float32 logits and gradient). ``AllocatorTemps``
reads and resets the allocator's peaks at every window edge and step end: what a window's peak exceeds the baseline
(held beyond the ledger as the step's first window opened: cuBLAS workspaces, ``untracked_bytes``) plus the
ledger's window peak goes into its ``temp`` and ``total`` (deep mode: rounding, stream-ordered frees)."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_mem_otel.schema import TEMP, TOTAL, DeviceBreakdown, device_counters
from fsdp_mem_otel.training.light.counters import Snap, snap_of
from fsdp_mem_otel.training.light.ledger import INDEX, RawBreakdown

_T, _TEMP = INDEX[TOTAL], INDEX[TEMP]


class AllocatorTemps:
    """The ledger's window edges (``Ledger.window_watch``) mirrored on the allocator's peak counters."""

    def __init__(self, probe: Any) -> None:
        self._probe = probe
        #: per open window, innermost last: device -> [allocator peak so far, baseline]
        self._open: list[dict[str, list[int]]] = []
        self._step: dict[str, list[int]] = {}  # the same for the step; {} until its first window

    def _edge(self) -> dict[str, tuple[int, int]]:
        readings: dict[str, tuple[int, int]] = self._probe.window_edge()
        for device, (peak, _) in readings.items():
            for w in (*self._open, self._step):
                held = w.get(device)
                if held is not None and peak > held[0]:
                    held[0] = peak
        return readings

    def opened(self, current: RawBreakdown) -> None:
        readings = self._edge()
        window = {}
        for device, (_, now) in readings.items():
            counters = current.get(device)
            step = self._step.get(device)
            if step is None:  # the step's first window: what is untracked now is the baseline
                step = self._step[device] = [now, now - (counters[_T] if counters else 0)]
            window[device] = [now, step[1]]
        self._open.append(window)

    def closed(self, index: int, snap: Snap) -> Snap:
        """Window ``index`` closed with ledger peak ``snap``: ``snap`` with the allocator's excess in ``temp``."""
        self._edge()
        if not -len(self._open) <= index < len(self._open):  # out of step with the ledger: start over
            self._open.clear()
            return snap
        window = self._open.pop(index)
        counters = dict(device_counters(snap))
        adjusted = False
        for device, (allocator_peak, baseline) in window.items():
            held = counters.get(device)
            excess = allocator_peak - baseline - (held[_T] if held else 0)
            if excess > 0:
                cats = list(held) if held else [0] * len(INDEX)
                cats[_TEMP] += excess
                cats[_T] += excess
                counters[device] = cats
                adjusted = True
        return snap_of(counters) if adjusted else snap

    def step_peak(self, peak: DeviceBreakdown) -> DeviceBreakdown:
        """The step's peak breakdown (in place) with the allocator's excess in ``temp``; then starts afresh."""
        self._edge()
        for device, (allocator_peak, baseline) in self._step.items():
            cats = peak.get(device)
            excess = allocator_peak - baseline - (cats[TOTAL] if cats else 0)
            if excess > 0:
                if cats is None:
                    cats = peak[device] = dict.fromkeys(INDEX, 0)
                cats[TEMP] += excess
                cats[TOTAL] += excess
        self._open.clear()
        self._step = {}
        return peak


def allocator_temps(probe: Any, reset_peaks: bool) -> AllocatorTemps | None:
    """The ledger's ``window_watch``: an ``AllocatorTemps`` with ``reset_peaks`` where CUDA is, else None."""
    return AllocatorTemps(probe) if reset_peaks and torch.cuda.is_available() else None
