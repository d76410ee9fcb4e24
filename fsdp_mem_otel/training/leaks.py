"""Leak detection: what stays alive at each step's end, and whether it grows. ``LeakWatch`` keeps the last
``window`` step-end totals per category and calls one growing when, over at least ``2 * min_steps`` of them, it
never fell and rose ``min_steps`` times and at half the steps or more: a plateau, the optimizer state created at
step 1, a learning-rate warm-up that changes nothing in memory never qualify; a graph kept every step
(``losses.append(loss)``) does, even every other step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from operator import itemgetter, mul
from typing import Any

from fsdp_mem_otel.schema import CATEGORY_KEYS, DeviceBreakdown, LeakReport, device_counters

#: step ends in the window by default (FSDP_MEM_OTEL_LEAK_WINDOW)
DEFAULT_WINDOW = 30
#: consecutive rises that make a category growing
DEFAULT_MIN_STEPS = 5
#: modules named in a report, the largest holders first
TOP_HOLDERS = 8
_KEYS = CATEGORY_KEYS  # the categories and their total, in the order of a snapshot's counters
_NOTHING = (0,) * len(_KEYS)


class LeakWatch:
    """Step-end totals per category over the last ``window`` steps; see the module docstring."""

    def __init__(self, window: int = DEFAULT_WINDOW, min_steps: int = DEFAULT_MIN_STEPS) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 4:
            raise ValueError(f"window must be an int >= 4; got {window!r}")
        if not isinstance(min_steps, int) or isinstance(min_steps, bool) or not 2 <= min_steps <= window // 2:
            raise ValueError(f"min_steps must be an int from 2 to window / 2 ({window // 2}); got {min_steps!r}")
        self.window = window
        self.min_steps = min_steps
        # per step end, bytes indexed like _KEYS; only appended to (reports read it later); restarted at 2 windows
        self._ends: list[tuple[int, ...]] = []

    def observe(self, current: DeviceBreakdown, held: dict[str, int]) -> LeakReport | None:
        """One step end: what is growing and who holds what, or None when nothing is."""
        counters = {d: tuple(cats.get(c, 0) for c in _KEYS) for d, cats in current.items()}
        return self.observe_later(counters, held)()

    def observe_later(self, snap: Any, held: dict[str, int]) -> Callable[[], LeakReport | None]:
        """``observe`` with a snapshot's counters; the report built when called, on any thread."""
        # every step, on the training thread: keep the totals, no copy of the window
        if len(snap) == 2 and snap.__class__ is tuple:  # one device: nearly every job
            totals = snap[1]
        else:
            columns = [c for _, c in device_counters(snap)]
            totals = tuple(map(sum, zip(*columns, strict=True))) if columns else _NOTHING
        ends = self._ends
        if len(ends) >= 2 * self.window:
            ends = self._ends = ends[-self.window:]  # the reports taken so far keep the old list
        ends.append(totals)
        holding = [kv for kv in held.items() if kv[1] > 0] if held and max(held.values()) > 0 else []
        return functools.partial(_leak_report, ends, len(ends), self.window, holding, self.min_steps)


def _leak_report(log: list[tuple[int, ...]], n: int, window: int, holding: list[tuple[str, int]],
                 min_steps: int) -> LeakReport | None:
    """What grows over the ``window`` step ends before ``n``, and who of ``holding`` holds most; None: nothing."""
    ends = log[max(0, n - window):n]
    growing: dict[str, float] = {}
    if len(ends) >= 2 * min_steps:
        first, totals = ends[0], ends[-1]
        for i, last in enumerate(totals):
            # ending above the start settles the common flat category without a call
            if last > first[i] and (slope := _growth(ends, i, min_steps)) > 0:
                growing[_KEYS[i]] = slope
    if not growing and not holding:  # at a healthy step's end: no holder
        return None
    holders = dict(sorted(holding, key=lambda kv: -kv[1])) if holding else {}
    top = dict(list(holders.items())[:TOP_HOLDERS])
    return LeakReport(growing=growing, held=top, held_elsewhere=sum(holders.values()) - sum(top.values()),
                      steps=len(ends))


def _growth(ends: list[tuple[int, ...]], i: int, min_steps: int) -> float:
    # Category ``i``: never falling, rising ``min_steps`` times and at half the steps; closed-form LSQ slope.
    ys = list(map(itemgetter(i), ends))
    n = len(ys)
    if n < 2 * min_steps or ys[-1] <= ys[0] or ys != sorted(ys):
        return 0.0
    rises = len(set(ys)) - 1  # never falling: each rise reaches a value not seen before
    if rises < max(min_steps, (n - 1) // 2):
        return 0.0
    sum_xy = sum(map(mul, range(n), ys))
    return (2 * sum_xy - (n - 1) * sum(ys)) / (n * (n * n - 1) / 6)  # an exact integer numerator
