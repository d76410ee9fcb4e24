"""Leak detection: what stays alive at the end of each step, and whether it grows.

At every step end (after the optimizer step, where a healthy step holds no saved activation and
no temporary), ``LeakWatch.observe`` gets the live breakdown and, from light mode's saved-tensor
accounting, the bytes each FSDP module's saved tensors, inputs and outputs still hold. It keeps
the last ``window`` step-end totals per category and calls a category growing when, over those
steps (at least ``2 * min_steps`` of them), it never fell and rose at least ``min_steps`` times
and at half the steps or more: a
plateau after warm-up, the optimizer state created at step 1, a learning-rate warm-up that
changes nothing in memory, never qualify; a graph kept alive every step (``losses.append(loss)``
with ``retain_graph``), a list of each step's inputs, do, even every other step. The growth per
step is the least-squares slope over the window. Plain Python: unit-tested without FSDP.
"""

from __future__ import annotations

from collections import deque

from fsdp_mem_otel.schema import CATEGORIES, TOTAL, DeviceBreakdown, LeakReport

#: step ends in the window by default (FSDP_MEM_OTEL_LEAK_WINDOW)
DEFAULT_WINDOW = 30
#: consecutive rises that make a category growing
DEFAULT_MIN_STEPS = 5
#: modules named in a report, the largest holders first
TOP_HOLDERS = 8
_KEYS = (*CATEGORIES, TOTAL)


class LeakWatch:
    """Step-end totals per category over the last ``window`` steps; see the module docstring."""

    def __init__(self, window: int = DEFAULT_WINDOW, min_steps: int = DEFAULT_MIN_STEPS) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 4:
            raise ValueError(f"window must be an int >= 4; got {window!r}")
        if not isinstance(min_steps, int) or isinstance(min_steps, bool) or not 2 <= min_steps <= window // 2:
            raise ValueError(f"min_steps must be an int from 2 to window / 2 ({window // 2}); got {min_steps!r}")
        self.window = window
        self.min_steps = min_steps
        self._ends: deque[dict[str, int]] = deque(maxlen=window)

    def observe(self, current: DeviceBreakdown, held: dict[str, int]) -> LeakReport | None:
        """One step end: its live breakdown and the bytes each module's tensors still hold.
        Returns what is growing and who holds what, or None when nothing is."""
        totals = dict.fromkeys(_KEYS, 0)  # every step, on the training thread: loops, no generators
        for cats in current.values():
            for c in _KEYS:
                totals[c] += cats.get(c, 0)
        ends = self._ends
        ends.append(totals)
        growing: dict[str, float] = {}
        if len(ends) >= 2 * self.min_steps:
            first = ends[0]
            for c, last in totals.items():
                # Never falling and rising at least once means ending above the start: the common
                # flat category is settled here, without a call.
                if last > first[c] and (slope := self._growth(c)) > 0:
                    growing[c] = slope
        holding = [kv for kv in held.items() if kv[1] > 0]  # at a healthy step's end: none
        holders = dict(sorted(holding, key=lambda kv: -kv[1])) if holding else {}
        if not growing and not holders:
            return None
        top = dict(list(holders.items())[:TOP_HOLDERS])
        return LeakReport(growing=growing, held=top, held_elsewhere=sum(holders.values()) - sum(top.values()),
                          steps=len(self._ends))

    def _growth(self, category: str) -> float:
        # One pass (a leaking job calls this every step, for each growing category): never
        # falling, rising at least ``min_steps`` times and at half the steps or more; the slope is
        # the least-squares one, in closed form for x = 0..n-1.
        ends = self._ends
        n = len(ends)
        if n < 2 * self.min_steps or ends[-1][category] <= ends[0][category]:
            return 0.0
        prev = ends[0][category]
        rises = sum_y = sum_xy = 0
        x = 0
        for e in ends:
            y = e[category]
            if y < prev:
                return 0.0
            rises += y > prev
            sum_y += y
            sum_xy += x * y
            prev = y
            x += 1
        if rises < max(self.min_steps, (n - 1) // 2):
            return 0.0
        return (2 * sum_xy - (n - 1) * sum_y) / (n * (n * n - 1) / 6)  # an exact integer numerator
