"""The report's leak and forecast sections: HTML tables (and a chart each) from ``trends``.

Every row carries its figures as ``data-*`` attributes (exact: ``repr`` of the float), beside the
rounded text, so a reader (or a test) can take the numbers back out of the page.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fsdp_mem_otel.offline.table import human_bytes
from fsdp_mem_otel.offline.trends import (
    FORECAST_WINDOW_S,
    LEAK_MIN_STEPS,
    STEP_END,
    STEP_PEAK,
    Fit,
    RankForecast,
    RankLeaks,
    RankTrend,
    forecast_rows,
)
from fsdp_mem_otel.schema import TOTAL

#: ranks listed in full in each section; the rest are summed up in a line
MAX_RANKS_LISTED = 16
#: points per series drawn in the sections' charts
MAX_POINTS = 2000
SERIES_NAMES = {STEP_END: "step end", STEP_PEAK: "step peak"}
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


@dataclass
class Section:
    """One section of the page: trusted HTML and its charts ((id, caption, figure))."""

    id: str
    title: str
    html: str
    figures: list[tuple[str, str, Any]] = field(default_factory=list)
    #: one line for the page's summary table
    summary: str = ""


def _e(text: object) -> str:
    return html.escape(str(text))


def _attrs(**values: object) -> str:
    return "".join(f' data-{k.replace("_", "-")}="{_e(v)}"' for k, v in values.items() if v is not None)


def _unit(max_bytes: float) -> tuple[str, int]:
    for name, scale in _UNITS:
        if max_bytes >= scale:
            return name, scale
    return "B", 1


def _stride(n: int, max_points: int = MAX_POINTS) -> np.ndarray:
    if n <= max_points:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_points).round().astype(np.int64))


def hours_text(hours: float) -> str:
    """``0.001`` -> "4 s", ``0.25`` -> "15 min", ``5.3`` -> "5.3 h", ``100`` -> "100 h (4.2 days)"."""
    if hours < 1 / 60:
        return f"{hours * 3600:.0f} s"
    if hours < 1:
        return f"{hours * 60:.0f} min"
    if hours < 48:
        return f"{hours:.1f} h"
    return f"{hours:.0f} h ({hours / 24:.1f} days)"


def rank_list(ranks: Sequence[int]) -> str:
    """"0, 1, 2" or "0..1023" for runs of consecutive ranks."""
    runs: list[str] = []
    i = 0
    ranks = sorted(ranks)
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if i == j else (f"{ranks[i]}, {ranks[j]}" if j == i + 1
                                                   else f"{ranks[i]}..{ranks[j]}"))
        i = j + 1
    return ", ".join(runs)


def _per_step(v: float) -> str:
    return ("+" if v > 0 else "") + human_bytes(v) + "/step"


def _steps_text(findings: Sequence[RankLeaks]) -> str:
    counts = sorted({f.steps for f in findings})
    return f"{counts[0]} steps" if len(counts) == 1 else f"{counts[0]} to {counts[-1]} steps"


# -- leaks ---------------------------------------------------------------------------------------
def leak_section(findings: Sequence[RankLeaks], trends: dict[int, RankTrend], colors: dict[str, str]) -> Section:
    """Which categories keep growing on which ranks, by how much, since when, and who holds the
    bytes at the step end; else "No leak found over N steps"."""
    leaking = sorted((f for f in findings if f.leaking),
                     key=lambda f: (-max(g.fitted for g in f.growing), f.rank))
    windows = sorted({f.window for f in findings})
    window = str(windows[0]) if len(windows) == 1 else f"{windows[0]}..{windows[-1]}"
    rule = (f"A category grows when its step-end bytes (summed over the rank's devices) never fell over the "
            f"last {window} step ends and rose at {LEAK_MIN_STEPS} or more and at half of them or more (the "
            "tracker's detector, replayed on this run's figures); its growth is the least-squares slope of "
            "those step ends against the step numbers.")
    parts: list[str] = []
    figures: list[tuple[str, str, Any]] = []
    if not leaking:
        summary = f"no leak found over {_steps_text(findings)}"
        parts.append(f'<p class="ok" id="no-leak"{_attrs(ranks=len(findings))}>No leak found over '
                     f"{_e(_steps_text(findings))}: no category's step-end bytes grew steadily on "
                     f"{'the rank' if len(findings) == 1 else f'any of the {len(findings)} ranks'}, and the "
                     "tracker's detector reported none at the last step.</p>")
        parts.append(f'<p class="caption">{_e(rule)}</p>')
    else:
        cats = sorted({g.category for f in leaking for g in f.growing if g.category != TOTAL}) or [TOTAL]
        summary = (f"{', '.join(cats)} growing on {len(leaking)} of {len(findings)} ranks "
                   f"(up to {_per_step(max(g.fitted for f in leaking for g in f.growing))})")
        parts.append(f'<p class="leak">Growing at the last step on {len(leaking)} of {len(findings)} ranks '
                     f"({_e(rank_list([f.rank for f in leaking]))}): {_e(', '.join(cats))}.</p>")
        parts.append(f'<p class="caption">{_e(rule)} The tracker\'s figure is its own, from its latest leak '
                     "report naming the category.</p>")
        parts.append(_growth_table(leaking[:MAX_RANKS_LISTED]))
        if len(leaking) > MAX_RANKS_LISTED:
            rest = leaking[MAX_RANKS_LISTED:]
            parts.append(f"<p>... and {len(rest)} more ranks growing ({_e(rank_list([f.rank for f in rest]))}).</p>")
        fig = leak_figure(leaking[:8], trends, colors)
        if fig is not None:
            figures.append(("leak", "Step-end bytes of the growing categories per step, with the least-squares "
                            "line over the window (dashed).", fig))
    held = [f for f in (leaking or findings) if f.held][:MAX_RANKS_LISTED]
    if held:
        parts.append(_held_table(held, growing=bool(leaking)))
    stopped = [(f, g) for f in findings for g in f.stopped]
    if stopped:
        items = "".join(
            f"<li{_attrs(rank=f.rank, category=g.category, fitted=repr(g.fitted), since=g.since, until=g.until)}>"
            f"rank {f.rank}: {_e(g.category)} grew {_e(_per_step(g.fitted))} from step {g.since} to step "
            f"{g.until}, then stopped (now {_e(human_bytes(g.now))})</li>"
            for f, g in stopped[:MAX_RANKS_LISTED])
        more = f"<li>... and {len(stopped) - MAX_RANKS_LISTED} more</li>" if len(stopped) > MAX_RANKS_LISTED else ""
        parts.append(f'<p>Grew for a while and stopped (a warm-up, a cache filling, or a leak that was '
                     f'released):</p><ul class="stopped">{items}{more}</ul>')
    return Section("leaks", "Leaks", "\n".join(parts), figures, summary)


def _growth_table(leaking: Sequence[RankLeaks]) -> str:
    rows = ["<table class=\"trend\" id=\"leak-table\"><tr><th>rank</th><th>category</th>"
            "<th>growth (this run, least squares)</th><th>tracker's figure</th><th>growing since</th>"
            "<th>step-end bytes now</th></tr>"]
    for f in leaking:
        for g in f.growing:
            det = ("-" if g.detector is None else
                   f"{_per_step(g.detector)} at step {g.detector_step} (reported since step {g.detector_since})")
            attrs = _attrs(rank=f.rank, category=g.category, fitted=repr(g.fitted), window=f.window,
                           detector=None if g.detector is None else repr(g.detector),
                           detector_step=g.detector_step, detector_since=g.detector_since, since=g.since, now=g.now)
            rows.append(
                f"<tr{attrs}><td>{f.rank}</td><td>{_e(g.category)}</td><td>{_e(_per_step(g.fitted))} over the last "
                f"{min(f.window, f.steps)} step ends</td><td>{_e(det)}</td><td>step {g.since}</td>"
                f"<td>{_e(human_bytes(g.now))} at step {f.last_step}</td></tr>")
    rows.append("</table>")
    return "".join(rows)


def _held_table(ranks: Sequence[RankLeaks], growing: bool) -> str:
    what = ("Still held at the last step's end, by the FSDP module whose saved tensors, inputs and outputs "
            "they are (light mode; the largest holders):" if growing else
            "Held at the last step's end though nothing grows (saved tensors, inputs and outputs of these "
            "modules, light mode):")
    rows = [f"<p>{_e(what)}</p><table class=\"trend\" id=\"held-table\"><tr><th>rank</th><th>module</th>"
            "<th>bytes held</th></tr>"]
    for f in ranks:
        for module, n in sorted(f.held.items(), key=lambda kv: (-kv[1], kv[0])):
            rows.append(f"<tr{_attrs(rank=f.rank, module=module, bytes=n)}><td>{f.rank}</td><td>{_e(module)}</td>"
                        f"<td>{_e(human_bytes(n))}</td></tr>")
        if f.held_elsewhere:
            rows.append(f"<tr{_attrs(rank=f.rank, module='(elsewhere)', bytes=f.held_elsewhere)}><td>{f.rank}</td>"
                        f"<td>(other modules)</td><td>{_e(human_bytes(f.held_elsewhere))}</td></tr>")
    rows.append("</table>")
    return "".join(rows)


def leak_figure(leaking: Sequence[RankLeaks], trends: dict[int, RankTrend], colors: dict[str, str]) -> Any:
    """Per leaking rank and growing category: step-end bytes per step, and the fitted line (dashed)."""
    import plotly.graph_objects as go

    top = max((int(trends[f.rank].end_bytes(g.category).max(initial=0)) for f in leaking for g in f.growing),
              default=0)
    if top <= 0:
        return None
    uname, scale = _unit(top)
    fig = go.Figure()
    for f in leaking:
        t = trends[f.rank]
        idx = _stride(len(t.steps))
        for g in f.growing:
            ys = t.end_bytes(g.category)
            color = colors.get(g.category, "#222")
            name = f"rank {f.rank} {g.category}"
            fig.add_scatter(x=t.steps[idx], y=ys[idx] / scale, mode="lines+markers", name=name,
                            line={"color": color}, marker={"size": 4},
                            meta={"rank": f.rank, "category": g.category, "kind": "step_end"},
                            hovertemplate=f"step %{{x}}<br>{name}: %{{y:.4~f}} {uname}<extra></extra>")
            lo = max(0, len(t.steps) - f.window)
            x0, x1 = float(t.steps[lo]), float(t.steps[-1])
            xs = t.steps[lo:].astype(np.float64)
            mean_x, mean_y = float(xs.mean()), float(ys[lo:].astype(np.float64).mean())
            y0 = mean_y + g.fitted * (x0 - mean_x)
            y1 = mean_y + g.fitted * (x1 - mean_x)
            fig.add_scatter(x=[x0, x1], y=[y0 / scale, y1 / scale], mode="lines", name=f"{name} fit",
                            line={"color": color, "dash": "dash"}, showlegend=False,
                            meta={"rank": f.rank, "category": g.category, "kind": "fit"},
                            hovertemplate=f"{name}: {_per_step(g.fitted)}<extra>least squares</extra>")
    fig.update_layout(title="Growing step-end bytes", xaxis_title="step", yaxis_title=f"step-end bytes ({uname})",
                      template="plotly_white", height=420, meta={"unit": uname, "scale": scale})
    return fig


# -- forecast ------------------------------------------------------------------------------------
def forecast_section(forecasts: Sequence[RankForecast], trends: dict[int, RankTrend],
                     window_s: float = FORECAST_WINDOW_S, capacity_given: int | None = None) -> Section:
    """Per rank: steady growth per hour of the step-end and step-peak totals and the hours until
    the capacity; "flat: no forecast" where neither grows steadily."""
    span = hours_text(window_s / 3600)
    rule = (f"Least-squares growth of each rank's step-end and step-peak totals (its main device) against "
            f"time, over the last {span} of the run (the whole run when shorter). Only steady growth counts: "
            "up over the window and over each of its halves, so the optimizer state created at step 1 or a "
            "warm-up that levels off gives no forecast. Hours to capacity: (capacity - fitted value now) / "
            "growth, the sooner of the two series.")
    if capacity_given is not None:
        rule += f" Capacity: {human_bytes(capacity_given)} ({capacity_given} bytes, --capacity) on every rank."
    else:
        rule += " Capacity: the CUDA device's total memory; give --capacity for a CPU run or a what-if."

    def key(fc: RankForecast) -> tuple[int, float, int]:
        if fc.hours is not None:
            return (0, fc.hours, fc.rank)
        return (1 if fc.steady else 2, -max((f.per_hour for f in fc.steady), default=0.0), fc.rank)

    ordered = sorted(forecasts, key=key)
    growing = [fc for fc in ordered if fc.steady]
    with_hours = [fc for fc in ordered if fc.hours is not None]
    parts: list[str] = []
    if not growing:
        summary = "flat: no forecast"
        parts.append(f'<p class="ok" id="no-forecast">Flat: no forecast. No rank\'s step-end or step-peak total '
                     f"grew steadily ({len(forecasts)} rank{'s' if len(forecasts) != 1 else ''}).</p>")
    else:
        soonest = with_hours[0] if with_hours else None
        summary = (f"rank {soonest.rank} reaches {human_bytes(soonest.capacity or 0)} in "
                   f"{hours_text(soonest.hours or 0.0)}" if soonest is not None else
                   f"growing on {len(growing)} ranks; no capacity known (give --capacity)")
        parts.append(f'<p class="leak">Growing steadily on {len(growing)} of {len(forecasts)} ranks'
                     f"{'' if soonest is None else f'; the first to reach its capacity: rank {soonest.rank}, in '}"
                     f"{'' if soonest is None else _e(hours_text(soonest.hours or 0.0))}.</p>")
    parts.append(f'<p class="caption">{_e(rule)}</p>')
    listed = ordered[:MAX_RANKS_LISTED] if growing else []
    if listed:
        parts.append(_forecast_table(listed))
        rest = ordered[MAX_RANKS_LISTED:]
        if rest:
            flat = [fc.rank for fc in rest if not fc.steady]
            parts.append(f"<p>... and {len(rest)} more ranks ({len(flat)} flat: no forecast).</p>")
    figures: list[tuple[str, str, Any]] = []
    if with_hours:
        figures.append(("forecast", "The soonest rank's step-end and step-peak totals over the window, their "
                        "least-squares lines carried on to the capacity.",
                        forecast_figure(with_hours[0], trends[with_hours[0].rank])))
    return Section("forecast", "Forecast", "\n".join(parts), figures, summary)


def _fit_cell(f: Fit | None) -> str:
    if f is None:
        return "<td>-</td>"
    if not f.steady:
        return f"<td>{_e(human_bytes(f.last))} now; flat</td>"
    return f"<td>{_e(human_bytes(f.now))} now, {_e(('+' if f.per_hour > 0 else '') + human_bytes(f.per_hour))}/h</td>"


def _forecast_table(rows_in: Sequence[RankForecast]) -> str:
    rows = ["<table class=\"trend\" id=\"forecast-table\"><tr><th>rank</th><th>device</th><th>capacity</th>"
            "<th>step end</th><th>step peak</th><th>hours to capacity</th></tr>"]
    for fc in rows_in:
        fits = {f.series: f for f in fc.fits}
        end, peak = fits.get(STEP_END), fits.get(STEP_PEAK)
        if fc.hours is not None:
            verdict = f"{hours_text(fc.hours)} ({SERIES_NAMES[fc.series or STEP_END]})"
        elif fc.steady:
            verdict = "growing; no capacity known (give --capacity)"
        else:
            verdict = "flat: no forecast"
        cap = "-" if fc.capacity is None else f"{human_bytes(fc.capacity)} ({fc.capacity_source})"
        attrs = _attrs(rank=fc.rank, device=fc.device, capacity=fc.capacity,
                       hours=None if fc.hours is None else repr(fc.hours), series=fc.series,
                       end_per_hour=repr(end.per_hour) if end is not None and end.steady else None,
                       end_now=repr(end.now) if end is not None else None,
                       peak_per_hour=repr(peak.per_hour) if peak is not None and peak.steady else None,
                       peak_now=repr(peak.now) if peak is not None else None)
        rows.append(f"<tr{attrs}><td>{fc.rank}</td><td>{_e(fc.device)}</td><td>{_e(cap)}</td>{_fit_cell(end)}"
                    f"{_fit_cell(peak)}<td>{_e(verdict)}</td></tr>")
    rows.append("</table>")
    return "".join(rows)


def forecast_figure(fc: RankForecast, trend: RankTrend) -> Any:
    """Hours from the rank's last step (0) on x: each series over the forecast window, and the
    fitted lines of those growing steadily carried on to the capacity."""
    import plotly.graph_objects as go

    assert fc.capacity is not None and fc.hours is not None
    uname, scale = _unit(float(fc.capacity))
    fig = go.Figure()
    end_h = fc.hours if math.isfinite(fc.hours) else 0.0
    ok = forecast_rows(trend)
    for f in fc.fits:
        cols = trend.end_totals if f.series == STEP_END else trend.peak_totals
        inside = ok & (trend.times >= f.start) & (trend.times <= f.end)
        idx = np.flatnonzero(inside)[_stride(int(inside.sum()))]
        name = SERIES_NAMES[f.series]
        fig.add_scatter(x=(trend.times[idx] - f.end) / 3600, y=cols[fc.device][idx] / scale, mode="markers",
                        name=name, marker={"size": 4}, text=[f"step {s}" for s in trend.steps[idx]],
                        meta={"series": f.series, "kind": "data"},
                        hovertemplate=f"%{{text}}, %{{x:.3f}} h: %{{y:.4~f}} {uname}<extra>{name}</extra>")
    for f in fc.steady:
        x0 = (f.start - f.end) / 3600
        reach = f.hours_to(fc.capacity)
        x1 = reach if reach is not None else end_h
        y0 = f.now + f.slope * (f.start - f.end)
        y1 = f.now + f.slope * x1 * 3600
        fig.add_scatter(x=[x0, 0.0, x1], y=[y0 / scale, f.now / scale, y1 / scale], mode="lines",
                        name=f"{SERIES_NAMES[f.series]} (fitted)", line={"dash": "dash"},
                        meta={"series": f.series, "kind": "fit"},
                        hovertemplate=f"%{{x:.2f}} h: %{{y:.4~f}} {uname}<extra>{SERIES_NAMES[f.series]}</extra>")
    lo = min(((f.start - f.end) / 3600 for f in fc.fits), default=0.0)
    hi = max([end_h, *(h for f in fc.steady if (h := f.hours_to(fc.capacity)) is not None)])
    fig.add_scatter(x=[lo, hi], y=[fc.capacity / scale] * 2, mode="lines", name="capacity",
                    line={"color": "#D62728"}, meta={"kind": "capacity"})
    fig.update_layout(title=f"Forecast, rank {fc.rank} ({fc.device})", xaxis_title="hours from the last step",
                      yaxis_title=f"memory ({uname})", template="plotly_white", height=420,
                      meta={"rank": fc.rank, "unit": uname, "scale": scale})
    return fig
