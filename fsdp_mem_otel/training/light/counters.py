"""Counters of bytes per device and category, with per-step and per-window peaks: the ledger's arithmetic half
(``ledger.Ledger`` adds the tracked storages); no torch. Every change (``add_at``) is O(1): one device's counters,
the step window and the innermost open window; closing a window folds its peak into the enclosing one. A ``Snap``
is one flat tuple, untracked by the cyclic collector after one collection. Light mode defers: changes and events go
into the *log* (``pending``), applied in one loop by ``flush()`` when first read (caches stay warm)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from fsdp_mem_otel.schema import CATEGORY_KEYS, DeviceBreakdown, breakdown_of
from fsdp_mem_otel.training.light import log

#: category key -> its index in a counter list
INDEX: dict[str, int] = {c: i for i, c in enumerate(CATEGORY_KEYS)}
_N = len(CATEGORY_KEYS)
_T = INDEX["total"]

#: device -> counters (a list indexed like CATEGORY_KEYS): the live counters, ``raw()``
RawBreakdown = dict[str, list[int]]
#: ``(device, counters, device, counters, ...)``: a snapshot, counters as tuples (see above)
Snap = tuple[Any, ...]


def snap_of(counters: dict[str, Any]) -> Snap:
    """``counters`` (device -> counter sequence) as a ``Snap``."""
    if len(counters) == 1:
        for d, c in counters.items():
            return (d, tuple(c))
    out: list[Any] = []
    for d, c in counters.items():
        out.append(d)
        out.append(tuple(c))
    return tuple(out)


def totals_of(snap: Snap) -> dict[str, int]:
    """Each device's total in ``snap``."""
    out = {}
    for i in range(0, len(snap), 2):  # a loop, not a comprehension: no frame of its own (3.11)
        out[snap[i]] = snap[i + 1][_T]
    return out


class WindowWatch(Protocol):
    """Told of every window edge, in time (``AllocatorTemps``); it may adjust the windows' and step's peaks."""

    def opened(self, current: RawBreakdown) -> None: ...

    def closed(self, index: int, snap: Snap) -> Snap: ...

    def step_peak(self, peak: DeviceBreakdown) -> DeviceBreakdown: ...


def _call(method: Callable[..., None], args: list[Any]) -> None:
    method(*args)


def _hand_on(keep: Callable[[list[Any]], None], part: list[Any], failures: list[Exception]) -> None:
    """``keep(part)``; a failure is one of the flush's (the counters are up to date: it goes on)."""
    try:
        keep(part)
    except Exception as exc:  # noqa: BLE001
        failures.append(exc)


class _Window:
    """One span's peak: per device, the largest total and the counters then, copied only when about to shrink, a
    window opens, or it is read (a live peak): not at every allocation. ``totals_only``: no counters."""

    __slots__ = ("live", "peak", "snap")

    def __init__(self, current: RawBreakdown, totals_only: bool = False) -> None:
        # one loop, no comprehensions: windows open on the hot path (a module's forward, backward)
        self.peak: dict[str, int] = {}
        self.live: set[str] = set()
        if totals_only:
            self.snap: dict[str, tuple[int, ...]] | None = None
            for d, c in current.items():
                self.peak[d] = c[_T]
            return
        self.snap = {}
        for d, c in current.items():
            self.peak[d] = c[_T]
            self.snap[d] = tuple(c)

    def offer(self, device: str, total: int) -> None:
        if total > self.peak.get(device, -1):
            self.peak[device] = total
            self.live.add(device)

    def settle(self, current: RawBreakdown, device: str | None = None) -> None:
        """Copy the live peaks (all devices, or one) out of ``current`` before it changes."""
        if not self.live:
            return
        snap = self.snap
        if snap is None:  # totals only: nothing to copy
            self.live.clear()
        elif device is None:
            for d in self.live:
                snap[d] = tuple(current[d])
            self.live.clear()
        elif device in self.live:
            snap[device] = tuple(current[device])
            self.live.discard(device)

    def absorb(self, inner: _Window) -> None:
        snap, inner_snap = self.snap, inner.snap
        for device, total in inner.peak.items():
            if total > self.peak.get(device, -1):
                self.peak[device] = total
                if snap is not None and inner_snap is not None:
                    snap[device] = inner_snap[device]
                self.live.discard(device)

    def total(self) -> int:
        """The largest total of any device (0 for none)."""
        return max(self.peak.values(), default=0)


class Counters:
    """Live bytes per device and category, plus peaks for the step and for nested windows."""

    def __init__(self) -> None:
        self._cur: RawBreakdown = {}
        self._step = _Window({})
        self._windows: list[_Window] = []
        # Light: every growth is a peak candidate; deep offers once per op (offer_current), as upstream MemTracker.
        self.offer_on_add = True
        self.window_watch: WindowWatch | None = None  # told of window edges, or None
        #: deferred mode: changes and recorder events waiting for ``flush``, flat (see ``flush``), else None
        self.pending: list[Any] | None = None
        self._flushing = False
        #: seconds spent flushing (the sink counts them in its overhead and zeroes them per step)
        self.flush_seconds = 0.0
        #: told of each event that fails in a flush (the tracker counts them); None: ``flush`` raises
        self.on_flush_error: Callable[[BaseException], None] | None = None
        #: where each flush hands what it applied (``retain``), or None
        self._retained: Callable[[list[Any]], None] | None = None

    def defer(self, on: bool) -> None:
        """Queue changes until read (``on``) or apply them at once; never with a ``window_watch``."""
        self.flush()
        self.pending = [] if on and self.window_watch is None else None

    def watch_windows(self, watch: WindowWatch | None) -> None:
        """Tell ``watch`` (or None) of every window edge; a watch turns deferral off."""
        self.flush()
        self.window_watch = watch
        self.defer(watch is None)

    def retain(self, keep: Callable[[list[Any]], None] | None) -> None:
        """Hand ``keep`` each flushed part of the log, in order (for ``recorder.StepReplay``); None: stop."""
        self.flush()
        self._retained = keep

    def flush(self) -> None:
        """Apply the log in order (``log.take``); a failing entry stops no other (``on_flush_error``, else the
        first raises)."""
        pending = self.pending
        if not pending or self._flushing:
            return
        self._flushing = True
        started = time.perf_counter()
        failures: list[Exception] = []
        part: list[Any] = []
        try:
            part = log.take(pending, self.apply, _call, failures)
        finally:
            self._flushing = False
            if self._retained is not None and part:
                _hand_on(self._retained, part, failures)
            self.flush_seconds += time.perf_counter() - started
        if failures:
            if self.on_flush_error is None:
                raise failures[0]
            for err in failures:
                self.on_flush_error(err)

    def queue(self, event: Callable[..., None], *args: Any) -> None:
        """``event(*args)`` now, or at the next flush where changes are deferred (time last)."""
        pending = self.pending
        if pending is None:
            event(*args)
        else:
            log.event(pending, event, *args)

    @property
    def flushing(self) -> bool:
        """Whether ``flush`` is running now (what it runs sees the counters as they stand)."""
        return self._flushing

    def start_from(self, counters: RawBreakdown) -> None:
        """Set the live counters to ``counters`` and start a step there (a replayed step's start)."""
        self._cur = {d: c[:] for d, c in counters.items()}
        self.reset_step()

    # -- changes -------------------------------------------------------------------------------
    def add_at(self, device: str, cat: int, delta: int) -> None:
        """Add ``delta`` bytes to category index ``cat`` on ``device``: at once, or queued where deferring."""
        pending = self.pending
        if pending is not None:
            log.change(pending, device, cat, delta)
        else:
            self.apply(device, cat, delta)

    def apply(self, device: str, cat: int, delta: int) -> None:
        """``add_at`` at once, deferring or not (a flush's or a replay's change)."""
        # Written out, no helper calls unless a window is live: every change of a flush and a replay runs here.
        cats = self._cur.get(device)
        if cats is None:
            cats = self._cur[device] = [0] * _N
        step = self._step
        windows = self._windows
        if delta < 0:  # the counters shrink: keep copies of the peaks they still are
            if device in step.live:
                step.settle(self._cur, device)
            if windows and device in windows[-1].live:
                windows[-1].settle(self._cur, device)
        cats[cat] += delta
        total = cats[_T] = cats[_T] + delta
        if delta > 0 and self.offer_on_add:
            if total > step.peak.get(device, -1):
                step.peak[device] = total
                step.live.add(device)
            if windows:
                inner = windows[-1]
                if total > inner.peak.get(device, -1):
                    inner.peak[device] = total
                    inner.live.add(device)

    def offer_current(self) -> None:
        """Make the current counters a peak candidate for the step and the innermost window."""
        self.flush()
        inner = self._windows[-1] if self._windows else None
        for device, cats in self._cur.items():
            self._step.offer(device, cats[_T])
            if inner is not None:
                inner.offer(device, cats[_T])

    # -- windows and peaks ---------------------------------------------------------------------
    def open_window(self, totals_only: bool = False) -> None:
        """Start a nested peak window; ``totals_only``: its largest totals alone, no counters."""
        if self.pending is not None and not self._flushing:  # deferring, and not the flush's own
            self.flush()
        if self._windows:
            self._windows[-1].settle(self._cur)  # it stops receiving offers now
        if self.window_watch is not None:
            self.window_watch.opened(self._cur)
        self._windows.append(_Window(self._cur, totals_only))

    def open_totals_window(self) -> None:
        """``open_window(totals_only=True)`` for events a flush applies (nothing to flush, no watch)."""
        windows = self._windows
        if windows and windows[-1].live:
            windows[-1].settle(self._cur)
        windows.append(_Window(self._cur, True))

    def close_totals_window(self) -> int:
        """``close_window_total()`` (the innermost) for the flush's events, as ``open_totals_window``."""
        windows = self._windows
        if not windows:
            return 0
        w = windows.pop()
        if w.live:
            w.settle(self._cur)
        if windows:
            windows[-1].absorb(w)
        return w.total()

    def close_window_raw(self) -> Snap:
        """End the innermost window: its peak as a ``Snap``, folded into the enclosing one."""
        return self.close_window_at(-1)

    def close_window_at(self, index: int) -> Snap:
        """End open window ``index`` (-1: innermost), nested or not; its peak takes in later windows'. Raw."""
        w = self._close_window(index)
        if w is None:
            return ()
        snap = snap_of(w.snap or {})
        if self.window_watch is None:
            return snap
        return self.window_watch.closed(len(self._windows) if index == -1 else index, snap)

    def close_window_total(self, index: int = -1) -> int:
        """``close_window_at`` for a ``totals_only`` window: its largest total of any device."""
        w = self._close_window(index)
        return 0 if w is None else w.total()

    def _close_window(self, index: int) -> _Window | None:
        # As ``close_window_at``; None when no window is open.
        if self.pending is not None and not self._flushing:  # deferring, and not the flush's own
            self.flush()
        windows = self._windows
        if not windows:
            return None
        if index == -1 or index == len(windows) - 1:
            w = windows.pop()
            w.settle(self._cur)
            if windows:
                windows[-1].absorb(w)
            return w
        w = windows[index]
        for inner in windows[index + 1:]:
            inner.settle(self._cur)
            w.absorb(inner)
        del windows[index]
        if index > 0:
            windows[index - 1].absorb(w)
        return w

    @property
    def open_windows(self) -> int:
        self.flush()
        return len(self._windows)

    def raw(self) -> RawBreakdown:
        """A copy of the current counters, ``{device: counter list}``."""
        if self.pending:
            self.flush()
        out = {}
        for d, c in self._cur.items():  # a loop, not a comprehension: no frame of its own (3.11)
            out[d] = c[:]
        return out

    def snap(self) -> Snap:
        """The current counters as a snapshot (``Snap``: what the step recorder keeps)."""
        if self.pending and not self._flushing:
            self.flush()
        return snap_of(self._cur)

    def snapshot(self) -> DeviceBreakdown:
        """The current breakdown, ``{device: {category: bytes}}`` (a copy; also ``current``)."""
        self.flush()
        return breakdown_of(self._cur)

    current = property(snapshot)

    def category_bytes(self, category: str) -> int:
        """Bytes of ``category`` now, summed over devices."""
        self.flush()
        i = INDEX[category]
        return sum(c[i] for c in self._cur.values())

    def step_peak(self) -> DeviceBreakdown:
        self.flush()
        self._step.settle(self._cur)
        peak = breakdown_of(self._step.snap)
        return peak if self.window_watch is None else self.window_watch.step_peak(peak)

    def reset_step(self) -> None:
        """Start a new step: the step peak restarts from what is live now; windows are dropped."""
        self.flush()
        self._step = _Window(self._cur)
        self._windows.clear()
