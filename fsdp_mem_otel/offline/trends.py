"""What a run's step-end and step-peak bytes say over time: leaks, and when a rank runs out of memory.

numpy only (no torch): ``report`` builds its leak and forecast sections from this.

Leaks (:func:`find_leaks`). The tracker's detector (``training/leaks.py``, ``LeakWatch``) calls a
category growing when its step-end bytes, summed over the rank's devices, never fell over its last
``window`` step ends (at least ``2 * LEAK_MIN_STEPS`` of them) and rose at ``LEAK_MIN_STEPS`` of
them or more and at half of them or more; its figure is the least-squares slope over that window,
and ``StepReport.leak`` carries it. Offline the same rule is replayed on the JSONL's own step-end
bytes (``StepReport.current``), so a file written before the detector existed gets the same
answer, and the run's own figure is the least-squares growth over the last ``window`` step ends
(bytes per step, against the step numbers). The window is the detector's own where the JSONL shows
it (a leak report that looked at fewer step ends than the step number), else ``LEAK_WINDOW``.
Which modules hold bytes at the step end comes from the last step's leak report (light mode).

Forecast (:func:`forecast`). As the ``FsdpMemCapacityForecast`` rule (``fleet/alerts.py``): per
rank, on its main device, the step-end total and the step-peak total are each fitted by least
squares against the step timestamps over the last ``FORECAST_WINDOW_S`` of the run (the whole run
when shorter), and only steady growth counts: the slope is positive over the window and over each
of its halves (by time), each half holding two points or more. So the optimizer state created at
step 1, or a warm-up that levels off, gives no forecast once it is more than half a window old.
Where growth is steady and a capacity is known (the CUDA device's ``device_total_bytes``, or one
given), the hours until the fitted line reaches it are ``(capacity - fitted now) / slope``
(0 once past it), the sooner of the two series. Aborted steps are left out of the fits, and deep
steps where the run has light ones (deep mode's peak counts more: mixed, they make a sawtooth).
"""

from __future__ import annotations

import math
import operator
import re
from array import array
from dataclasses import dataclass, field

import numpy as np

from fsdp_mem_otel.schema import CATEGORY_KEYS, DEEP, TOTAL, LeakReport, StepReport

#: training/leaks.py DEFAULT_WINDOW: step ends the detector looks at (FSDP_MEM_OTEL_LEAK_WINDOW)
LEAK_WINDOW = 30
#: training/leaks.py DEFAULT_MIN_STEPS: rises that make a category growing
LEAK_MIN_STEPS = 5
#: fleet/alerts.py RuleConfig.forecast_window ("1h"): the span the forecast fits over
FORECAST_WINDOW_S = 3600.0
STEP_END = "step_end"
STEP_PEAK = "step_peak"
_COL = {c: i for i, c in enumerate(CATEGORY_KEYS)}
_TOTAL = _COL[TOTAL]
_ZEROS = (0,) * len(CATEGORY_KEYS)
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> int:
    """A byte count from ``80GiB``, ``80 GB`` (10^9 bytes), ``512MiB``, ``1.5TiB`` or ``85899345920``;
    ``K``/``M``/``G``/``T`` without ``B`` are binary (``80G`` = 80 GiB). Above 0, else ``ValueError``."""
    m = _SIZE_RE.match(text)
    if m is None or (m.group(3) and not m.group(2)) or (m.group(3) and not m.group(4)):
        raise ValueError(f"expected a size such as 80GiB, 80GB or 85899345920; got {text!r}")
    number, prefix, binary, unit_b = m.group(1), m.group(2).lower(), m.group(3), m.group(4)
    base = 1000 if (prefix and unit_b and not binary) else 1024
    value = float(number) * base ** _POWERS[prefix]
    if not value >= 1 or not math.isfinite(value):
        raise ValueError(f"expected a size of 1 byte or more, such as 80GiB; got {text!r}")
    return int(round(value))


def least_squares(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Slope of the least-squares line through (x, y) and its value at ``x[-1]``; (nan, nan) when
    the x values do not spread. Integer y are taken relative to ``y[0]`` (exact in float64), so a
    constant series has slope exactly 0."""
    if len(x) < 2:
        return math.nan, math.nan
    xs = np.asarray(x, np.float64)
    base = y[0]
    ys = (np.asarray(y) - base).astype(np.float64)
    dx = xs - xs.mean()
    den = float(np.dot(dx, dx))
    if den == 0.0:
        return math.nan, math.nan
    my = float(ys.mean())
    slope = float(np.dot(dx, ys - my)) / den
    return slope, float(base) + my + slope * float(xs[-1] - xs.mean())


# -- collecting ----------------------------------------------------------------------------------
@dataclass(eq=False)
class RankTrend:
    """One rank's step-level figures over time, sorted by step (a step reported twice: the later).

    ``ends[i, c]``: step-end bytes of ``CATEGORY_KEYS[c]`` summed over the rank's devices (what
    the detector watches); ``end_totals`` / ``peak_totals``: device -> step-end / step-peak total
    per step; ``growing[i]``: bit ``c`` set where the step's leak report named ``CATEGORY_KEYS[c]``
    growing."""

    rank: int
    steps: np.ndarray
    times: np.ndarray
    aborted: np.ndarray
    deep: np.ndarray
    ends: np.ndarray
    end_totals: dict[str, np.ndarray]
    peak_totals: dict[str, np.ndarray]
    growing: np.ndarray
    #: the leak report of the last step (None: that step had none)
    last_leak: LeakReport | None
    #: category -> (step, bytes per step) of the latest leak report naming it growing
    detector: dict[str, tuple[int, float]]
    #: the detector's window where the JSONL shows it, else None
    window: int | None
    #: the largest number of step ends a leak report looked at
    leak_steps_max: int
    #: device -> its capacity in bytes (device_total_bytes, the latest reported)
    capacity: dict[str, int] = field(default_factory=dict)

    def end_bytes(self, category: str) -> np.ndarray:
        """Step-end bytes of ``category`` (summed over devices), per step."""
        return self.ends[:, _COL[category]]


class TrendBuilder:
    """Collects StepReports (step-level fields, any order) into one RankTrend per rank."""

    def __init__(self) -> None:
        self._ranks: dict[int, _RankColumns] = {}

    def add(self, report: StepReport) -> None:
        cols = self._ranks.get(report.rank)
        if cols is None:
            cols = self._ranks[report.rank] = _RankColumns(report.rank)
        cols.add(report)

    def build(self) -> dict[int, RankTrend]:
        return {rk: self._ranks[rk].build() for rk in sorted(self._ranks)}

    @classmethod
    def of(cls, reports: list[StepReport]) -> dict[int, RankTrend]:
        b = cls()
        for r in reports:
            b.add(r)
        return b.build()


class _RankColumns:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps = array("q")
        self.times = array("d")
        self.aborted = array("b")
        self.deep = array("b")
        self.ends = array("q")  # row-major, len(CATEGORY_KEYS) a row
        self.growing = array("q")
        self.dev_end: dict[str, tuple[array[int], array[int]]] = {}  # device -> (rows, values)
        self.dev_peak: dict[str, tuple[array[int], array[int]]] = {}
        self.last: tuple[int, LeakReport | None] = (-(1 << 62), None)
        self.detector: dict[str, tuple[int, float]] = {}
        self.window: int | None = None
        self.leak_steps_max = 0
        self.capacity: dict[str, tuple[int, int]] = {}

    def add(self, r: StepReport) -> None:
        row = len(self.steps)
        self.steps.append(r.step)
        self.times.append(float(r.timestamp))
        self.aborted.append(r.aborted is not None)
        self.deep.append(r.mode == DEEP)
        summed: list[int] | None = None
        for dev, cats in r.current.items():
            values = list(map(cats.get, CATEGORY_KEYS, _ZEROS))
            summed = values if summed is None else list(map(operator.add, summed, values))
            rows, vals = self.dev_end.setdefault(dev, (array("q"), array("q")))
            rows.append(row)
            vals.append(values[_TOTAL])
        self.ends.extend(_ZEROS if summed is None else summed)
        for dev, cats in r.peak.items():
            rows, vals = self.dev_peak.setdefault(dev, (array("q"), array("q")))
            rows.append(row)
            vals.append(cats.get(TOTAL, 0))
        for dev, stats in r.allocator.items():
            cap = stats.get("device_total_bytes")
            if cap is not None and cap > 0 and r.step >= self.capacity.get(dev, (-(1 << 62), 0))[0]:
                self.capacity[dev] = (r.step, int(cap))
        leak = r.leak
        bits = 0
        if leak is not None:
            for c, v in leak.growing.items():
                if c in _COL:
                    bits |= 1 << _COL[c]
                    if r.step >= self.detector.get(c, (-(1 << 62), 0.0))[0]:
                        self.detector[c] = (r.step, float(v))
            self.leak_steps_max = max(self.leak_steps_max, leak.steps)
            if 0 < leak.steps < r.step:  # the detector's window was full: its length is the window
                self.window = leak.steps
        self.growing.append(bits)
        if r.step >= self.last[0]:
            self.last = (r.step, leak)

    def build(self) -> RankTrend:
        n = len(self.steps)
        steps = np.frombuffer(self.steps, np.int64) if n else np.zeros(0, np.int64)
        order = np.argsort(steps, kind="stable")
        keep_last = np.ones(n, bool)
        keep_last[:-1] = steps[order][1:] != steps[order][:-1]
        keep = order[keep_last]
        width = len(CATEGORY_KEYS)
        ends = np.frombuffer(self.ends, np.int64).reshape(-1, width) if n else np.zeros((0, width), np.int64)

        def per_device(src: dict[str, tuple[array[int], array[int]]]) -> dict[str, np.ndarray]:
            out = {}
            for dev, (rows, vals) in sorted(src.items()):
                dense = np.zeros(n, np.int64)
                dense[np.frombuffer(rows, np.int64)] = np.frombuffer(vals, np.int64)
                out[dev] = dense[keep]
            return out

        def col(a: array[int] | array[float], dtype: type) -> np.ndarray:
            return np.frombuffer(a, dtype)[keep].copy() if n else np.zeros(0, dtype)

        return RankTrend(
            rank=self.rank, steps=steps[keep].copy(), times=col(self.times, np.float64),
            aborted=col(self.aborted, np.int8).astype(bool), deep=col(self.deep, np.int8).astype(bool),
            ends=ends[keep].copy(),
            end_totals=per_device(self.dev_end), peak_totals=per_device(self.dev_peak),
            growing=col(self.growing, np.int64), last_leak=self.last[1], detector=dict(self.detector),
            window=self.window, leak_steps_max=self.leak_steps_max,
            capacity={d: v for d, (_, v) in sorted(self.capacity.items())},
        )


# -- leaks ---------------------------------------------------------------------------------------
def growing_verdicts(values: np.ndarray, window: int, min_steps: int = LEAK_MIN_STEPS) -> np.ndarray:
    """Per row ``i``: the detector's verdict on the step ends ``values[i - window + 1 .. i]`` (fewer
    at the start): at least ``2 * min_steps`` of them, never falling, rising at ``min_steps`` steps
    or more and at half of them or more."""
    n = len(values)
    if n == 0:
        return np.zeros(0, bool)
    d = np.diff(np.asarray(values, np.int64))
    rises = np.concatenate(([0], np.cumsum(d > 0)))
    falls = np.concatenate(([0], np.cumsum(d < 0)))
    i = np.arange(n)
    start = np.maximum(0, i - window + 1)
    length = i - start + 1
    r = rises[i] - rises[start]
    f = falls[i] - falls[start]
    return (length >= 2 * min_steps) & (f == 0) & (r >= np.maximum(min_steps, (length - 1) // 2))


@dataclass
class Growth:
    """One category growing (or that grew) on one rank."""

    category: str
    #: least-squares growth of its step-end bytes over the last ``window`` step ends (or over the
    #: window that ended at ``until``), bytes per step
    fitted: float
    #: the first step whose step-end bytes rose, in the growing stretch
    since: int
    #: step-end bytes at the rank's last step
    now: int
    #: the tracker's own figure, from its latest leak report naming the category (None: never named)
    detector: float | None = None
    detector_step: int | None = None
    #: the first step of the detector's last unbroken run of reports naming it
    detector_since: int | None = None
    #: where it stopped growing before the last step: the last step it was judged growing
    until: int | None = None


@dataclass
class RankLeaks:
    """One rank's leak findings."""

    rank: int
    steps: int
    first_step: int
    last_step: int
    window: int
    growing: list[Growth]
    stopped: list[Growth]
    held: dict[str, int]
    held_elsewhere: int

    @property
    def leaking(self) -> bool:
        return bool(self.growing)


def _run_start(flags: np.ndarray, end: int) -> int:
    """The first row of the unbroken run of true ``flags`` that ends at row ``end``."""
    falses = np.flatnonzero(~flags[:end + 1])
    return int(falses[-1]) + 1 if len(falses) else 0


def find_leaks(trend: RankTrend) -> RankLeaks:
    """Categories growing at the rank's last step (by the offline replay or by the detector's last
    report), those that grew earlier and stopped, and the modules holding bytes at the last step."""
    n = len(trend.steps)
    window = trend.window or max(LEAK_WINDOW, trend.leak_steps_max)
    last_leak = trend.last_leak
    detector_now = set(last_leak.growing) if last_leak is not None else set()
    growing: list[Growth] = []
    stopped: list[Growth] = []
    for c in CATEGORY_KEYS:
        ys = trend.end_bytes(c)
        verdicts = growing_verdicts(ys, window)
        bit = 1 << _COL[c]
        named = (trend.growing & bit) != 0
        if not (verdicts.any() or named.any()):
            continue
        now_growing = bool(n and (verdicts[-1] or c in detector_now))
        flags = verdicts | named
        end = n - 1 if now_growing else int(np.flatnonzero(flags)[-1])
        first = _run_start(flags, end)
        lo = max(0, end - window + 1)
        slope, _ = least_squares(trend.steps[lo:end + 1], ys[lo:end + 1])
        base = max(0, first - window + 1)
        rises = np.flatnonzero(np.diff(ys[base:end + 1]) > 0)
        since = int(trend.steps[base + int(rises[0]) + 1]) if len(rises) else int(trend.steps[first])
        g = Growth(c, slope, since, int(ys[-1]))
        if c in trend.detector:
            g.detector_step, g.detector = trend.detector[c]
            k = int(np.searchsorted(trend.steps, g.detector_step))
            g.detector_since = int(trend.steps[min(_run_start(named, k), n - 1)])
        if now_growing:
            growing.append(g)
        else:
            g.until = int(trend.steps[end])
            stopped.append(g)
    growing.sort(key=lambda g: (g.category == TOTAL, -g.fitted))
    held = dict(last_leak.held) if last_leak is not None else {}
    return RankLeaks(
        rank=trend.rank, steps=n, first_step=int(trend.steps[0]) if n else 0,
        last_step=int(trend.steps[-1]) if n else 0, window=window, growing=growing, stopped=stopped,
        held=held, held_elsewhere=last_leak.held_elsewhere if last_leak is not None else 0,
    )


# -- forecast ------------------------------------------------------------------------------------
@dataclass
class Fit:
    """The least-squares line of one series over the forecast window."""

    series: str  # STEP_END or STEP_PEAK
    #: bytes per second over the window, and over its older and newer half
    slope: float
    older: float
    newer: float
    #: the fitted line at the window's last sample, and that sample's value
    now: float
    last: int
    points: int
    start: float  # the window's first sample time (seconds since the epoch)
    end: float

    @property
    def steady(self) -> bool:
        """Grew over the window and over each half (NaN, a half too thin to fit, fails)."""
        return self.slope > 0 and self.older > 0 and self.newer > 0

    @property
    def per_hour(self) -> float:
        return self.slope * 3600.0

    def hours_to(self, capacity: int) -> float | None:
        """Hours until the fitted line reaches ``capacity`` (0 once past it); None unless steady."""
        if not self.steady:
            return None
        return max(0.0, (capacity - self.now) / self.slope / 3600.0)


def fit_series(series: str, times: np.ndarray, values: np.ndarray, window_s: float = FORECAST_WINDOW_S) -> Fit | None:
    """``values`` over the last ``window_s`` seconds of ``times`` (all of them when the run is
    shorter), with the slope over each half of that span. None for fewer than 2 points or no
    time spread."""
    if len(times) < 2:
        return None
    t_last = float(times[-1])
    span = min(window_s, t_last - float(times[0]))
    if not span > 0:
        return None
    inside = times >= t_last - span
    t, y = times[inside], values[inside]
    newer = t >= t_last - span / 2
    slope, now = least_squares(t, y)
    if math.isnan(slope):
        return None
    old_slope = least_squares(t[~newer], y[~newer])[0] if (~newer).sum() >= 2 else math.nan
    new_slope = least_squares(t[newer], y[newer])[0] if newer.sum() >= 2 else math.nan
    return Fit(series, slope, old_slope, new_slope, now, int(y[-1]), len(t), float(t[0]), t_last)


@dataclass
class RankForecast:
    """One rank's forecast on its main device."""

    rank: int
    device: str
    fits: list[Fit]
    capacity: int | None
    capacity_source: str  # "device", "--capacity" or "" (none known)
    hours: float | None = None
    #: the series that reaches the capacity first
    series: str | None = None

    @property
    def steady(self) -> list[Fit]:
        return [f for f in self.fits if f.steady]


def forecast_rows(trend: RankTrend) -> np.ndarray:
    """The steps a forecast fits: completed, timestamped, and light where the run has light steps
    (a deep step's peak also counts what light mode does not see: a sawtooth, not growth)."""
    ok = ~trend.aborted & (trend.times > 0)
    light = ok & ~trend.deep
    return light if light.any() else ok


def forecast(trend: RankTrend, device: str, capacity: int | None = None,
             window_s: float = FORECAST_WINDOW_S) -> RankForecast:
    """Steady growth of the step-end and step-peak totals on ``device`` and, against ``capacity``
    (default: the device's own, where reported), the hours until the sooner reaches it."""
    ok = forecast_rows(trend)
    times = trend.times[ok]
    fits = []
    for name, cols in ((STEP_END, trend.end_totals), (STEP_PEAK, trend.peak_totals)):
        values = cols.get(device)
        if values is None:
            continue
        fit = fit_series(name, times, values[ok], window_s)
        if fit is not None:
            fits.append(fit)
    source = "--capacity" if capacity is not None else ("device" if device in trend.capacity else "")
    cap = capacity if capacity is not None else trend.capacity.get(device)
    out = RankForecast(trend.rank, device, fits, cap, source)
    if cap is not None:
        for f in fits:
            h = f.hours_to(cap)
            if h is not None and (out.hours is None or h < out.hours):
                out.hours, out.series = h, f.series
    return out
