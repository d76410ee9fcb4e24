"""Op temporaries on CUDA, from the caching allocator's own peak counters (``reset_peaks``, the
default where CUDA is).

Light mode sees the tensors FSDP holds, what autograd saves and what modules return, not what an
op allocates and frees inside itself: the float32 logits and their gradient in a language model's
loss, an MLP's intermediate gradients. On CUDA the allocator counts them. With ``reset_peaks`` (the
tracker owns the allocator's peak counters; the training script's readers see their own peaks
through ``shadow_peaks``), ``AllocatorTemps`` reads and resets the peaks at every peak-window edge,
as the ledger opens and closes the windows, and at the step's end:

- a window's allocator peak is the largest reading taken while it was open;
- the baseline is what the allocator held beyond the ledger's counters when the step's first
  window opened (cuBLAS workspaces, tensors the tracker never saw: ``untracked_bytes``), which
  stays out of every window of the step; what else no tracked tensor holds during a window
  (gradients flowing between modules, op temporaries) is in;
- what the allocator's peak exceeds baseline + the ledger's window peak was held by no tracked
  tensor: it is added to that window's ``temp`` (and ``total``).

So a module's or the step's peak becomes the allocator's, less the baseline, with the tracked
categories as the ledger saw them at its own peak. Deep mode sees every op, so there the excess is
what the allocator's rounding and stream-ordered frees add. Two C calls per edge and watched device
(about 12 us on an H200), plus the fold of the reading into the script's shadow peaks (one pass
over the reading's ``peak`` entries). ``reset_peaks=False`` (``FSDP_MEM_OTEL_RESET_PEAKS=0``) turns
it off: the counters stay untouched and light mode misses these temporaries.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_mem_otel.schema import TEMP, TOTAL, DeviceBreakdown, device_counters
from fsdp_mem_otel.training.light.counters import Snap, snap_of
from fsdp_mem_otel.training.light.ledger import INDEX, RawBreakdown

_T, _TEMP = INDEX[TOTAL], INDEX[TEMP]


class AllocatorTemps:
    """The ledger's window edges mirrored on the allocator's peak counters (module docstring).

    ``probe.window_edge()`` reads and resets the peaks: device key -> (allocated peak since the
    last edge, allocated now). The ledger (``Ledger.window_watch``) calls ``opened`` and
    ``closed`` at every window edge and ``step_peak`` at the step's end; the step's own window
    starts with its first module window (the first FSDP pre-forward).
    """

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
        """The window at ``index`` of the open ones closed with ledger peak ``snap``: ``snap`` with
        the allocator's excess added to ``temp`` (a new snapshot)."""
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
        """The step's peak breakdown (changed in place) with the allocator's excess in ``temp``;
        the next step starts afresh."""
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
