"""``fsdp-mem-otel report``: JSONL step reports -> one self-contained HTML page of charts.

Drawn with plotly (plotly.py builds the figures, plotly.js draws them in the browser); the page
inlines plotly.js and its own CSS once, so it opens offline and can be attached to a ticket.
Does not import torch.

What the page shows (each chart is a function taking StepReports, so tests feed synthetic ones):

* :func:`step_figure` - per step, the step peak stacked by category (the rank's main device: the
  CUDA device it trained on, else ``cpu``), with the allocator's allocated / reserved bytes (their
  sampled step peaks where reported; on the host, resident memory) as lines on the same axis.
  Deep steps carry a diamond, aborted steps (OOM or another exception) a red cross whose hover
  says in which module and state they stopped. A menu switches between ranks.
* :func:`module_figure` - one step of one rank: every module snapshot in execution order (sorted
  by the snapshot times: forward, then backward), stacked by category; the picture upstream
  FSDPMemTracker's tables give in numbers. Drawn for the selected step (``--step``, default the
  last) and for the step with the highest peak. An aborted step ends in a red bar: the live
  bytes at the moment it stopped, labelled with module and state.
* :func:`heatmap_figure` - rank x module, each module's peak (largest total over its states and
  calls) at the highest-peak step and at the selected step, same step number on every rank.
* :func:`skew_figure` - per step, max - min of the step peak across ranks.
* Leaks (``trends.find_leaks``, drawn by ``trends_html.leak_section``): per rank, the categories
  whose step-end bytes keep growing (the tracker's detector rule replayed on the file's own
  figures, so older files get the same answer), by how many bytes per step (least squares, beside
  the tracker's own figure), since which step, and the modules holding bytes at the last step's
  end; else "No leak found over N steps".
* Forecast (``trends.forecast``, ``trends_html.forecast_section``): per rank, the steady growth per
  hour of the step-end and step-peak totals over the last hour (as the FsdpMemCapacityForecast
  rule) and the hours until the device's capacity, or ``--capacity SIZE``; "flat: no forecast"
  where nothing grows steadily (a jump at step 1, a warm-up that levels off).

Downsampling (:func:`downsample`): a per-step series with at most ``max_points`` steps (default
2000) is drawn whole. A longer one is cut into ``max_points`` equal runs of consecutive steps;
each run is drawn by its highest-peak step, and every deep or aborted step is drawn as well.
Every plotted point is one real step (the stack adds up to that step's peak, the allocator lines
are that step's values), and the run's maximum is always among them. Module views and heatmaps
read module detail only for the few selected steps.

Reading large runs: a line is ``StepReport.to_dict()`` with sorted keys, and nearly all of its
bytes are in ``modules``. :func:`scan_files` parses only the step-level fields around it (the
text before ``"module_order"`` and from the last ``"peak"``), one file at a time, and keeps of
each step only the figures the charts draw, as per-rank columns (``run_index.StepSeries``, ~250
bytes a step: a 1,024-rank job of 1,000 steps in a few hundred MB); :class:`RunIndex` re-reads
the complete line of a step only when a chart needs its modules. A line that does not split that
way is parsed whole; one that does not parse is skipped with a warning, like ``read_reports``.

Many ranks: the per-step chart draws ``--max-ranks`` ranks (default 8: the highest step peaks
and the selected rank); :func:`fleet_figure` then shows, per step, the highest, median and
lowest step peak over every rank. The heatmap reads every rank's line at one or two steps.

Side index: where a data file has a consistent ``<file>.index`` (written by ``JSONLExporter``:
one entry per line with its step-level fields, byte offset and length), the step series come from
the index alone, and of the data file only the chosen steps' lines are read (seek + read) plus any
bytes the index does not cover (a line whose index entry a crash or an I/O error lost), scanned as
above. An index that is unreadable or does not fit its data file (an entry past the end of the
file, entries out of order or overlapping, an entry not ending at a line end) is ignored with a
warning and the file is scanned whole; a torn last index entry is skipped. Either way the reports
are the same as from a full scan.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fsdp_mem_otel.checks import int_at_least
from fsdp_mem_otel.cli_errors import ArgumentParser
from fsdp_mem_otel.offline import trends as trends_mod
from fsdp_mem_otel.offline.jsonl_format import (
    Progress,
    check_step_report_file,
    main_device,
    quiet,
    rotated_files,
    step_peak,
)
from fsdp_mem_otel.offline.run_index import RunIndex, StepSeries, scan_files
from fsdp_mem_otel.offline.trends import RankTrend, TrendBuilder
from fsdp_mem_otel.offline.trends_html import Section, forecast_section, leak_section
from fsdp_mem_otel.schema import CATEGORIES, FORWARD_PASS_STATES, STATES, TOTAL, StepReport

if TYPE_CHECKING:
    import plotly.graph_objects as go

DEFAULT_MAX_POINTS = 2000
#: ranks drawn in the per-step chart (the highest-peak ones); the fleet chart covers every rank
DEFAULT_MAX_RANKS = 8
#: category -> colour (plotly's qualitative palettes, fixed so pages compare side by side)
CATEGORY_COLORS: dict[str, str] = dict(
    zip(
        CATEGORIES,
        ("#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692", "#B6E880",
         "#FF97FF", "#FECB52", "#8C564B"),
        strict=True,
    )
)
DEEP_COLOR = "#6A0DAD"
ABORT_COLOR = "#D62728"
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}
_FWD = FORWARD_PASS_STATES

__all__ = ["RunIndex", "build_report", "downsample", "fleet_figure", "main_device", "render_html", "report_main",
           "scan_files", "scan_run", "step_figure", "step_peak", "write_report"]


def _plotly() -> Any:
    try:
        import plotly.graph_objects as go_mod
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "fsdp-mem-otel report needs plotly: pip install plotly (a plain install of fsdp-mem-otel has it)"
        ) from exc
    return go_mod


# -- data ----------------------------------------------------------------------------------------
def allocator_series(device: str) -> tuple[tuple[str, str], ...]:
    """(label, allocator key) pairs drawn for ``device``, first present wins per label."""
    if device == "cpu":
        return (("resident (RSS)", "resident_bytes"),)
    return (("allocator reserved", "reserved_peak_bytes|reserved_bytes"),
            ("allocator allocated", "allocated_peak_bytes|allocated_bytes"),
            ("outside PyTorch (CUDA context, NCCL, cuBLAS)", "outside_pytorch_bytes"))


def allocator_value(report: StepReport, device: str, keys: str) -> float | None:
    stats = report.allocator.get(device, {})
    for key in keys.split("|"):
        if key in stats:
            return float(stats[key])
    return None


def allocator_column(series: StepSeries, device: str, keys: str) -> np.ndarray | None:
    """Per step, the first of ``keys`` ("a|b") the step reported (NaN where none); None if no step
    reported any (as :func:`allocator_value`, for a whole series)."""
    out: np.ndarray | None = None
    for key in keys.split("|"):
        col = series.allocator_values(device, key)
        if col is None:
            continue
        out = col.copy() if out is None else np.where(np.isnan(out), col, out)
    return out


def downsample(peaks: Sequence[float] | np.ndarray, keep: Sequence[bool] | np.ndarray, max_points: int) -> list[int]:
    """Indices to draw: all when ``len(peaks) <= max_points``; else, out of ``max_points`` equal
    runs of consecutive indices, the index of each run's largest value (first on ties), plus
    every index where ``keep`` is true. Sorted; always holds the overall maximum."""
    n = len(peaks)
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1; got {max_points}")
    if n <= max_points:
        return list(range(n))
    values = np.asarray(peaks)
    chosen = set(np.flatnonzero(np.asarray(keep, dtype=bool)).tolist())
    for b in range(max_points):
        lo, hi = n * b // max_points, n * (b + 1) // max_points
        if hi > lo:
            chosen.add(lo + int(np.argmax(values[lo:hi])))
    return sorted(chosen)


# -- charts --------------------------------------------------------------------------------------
def pick_unit(max_bytes: float) -> tuple[str, int]:
    """Largest binary unit (GiB, MiB, KiB, B) that ``max_bytes`` reaches; dividing by a power of
    two is exact in float64, so plotted values times the unit give back the bytes."""
    for name, scale in _UNITS:
        if max_bytes >= scale:
            return name, scale
    return "B", 1


def _abort_text(r: StepReport) -> str:
    a = r.aborted
    if a is None:
        return ""
    kind = f"OOM, {a.error}" if a.oom else a.error
    where = f"{a.module or '(no module)'} at {a.state or '(no state)'}"
    return f"step {r.step} aborted ({kind}) in {where}: {a.message[:160]}"


def drawn_ranks(index: RunIndex, shown: int, max_ranks: int) -> list[int]:
    """The ranks the per-step chart draws: all up to ``max_ranks``, else ``shown`` and the ranks
    with the highest step peaks (ties: lower rank), ``max_ranks`` in all, in rank order."""
    ranks = index.ranks
    if len(ranks) <= max_ranks:
        return ranks
    best = sorted(ranks, key=lambda rk: (-_rank_peak(index, rk), rk))
    chosen = {shown, *[rk for rk in best if rk != shown][: max_ranks - 1]}
    return sorted(chosen)


def _rank_peak(index: RunIndex, rank: int) -> int:
    return int(index.series[rank].totals(index.device(rank)).max(initial=0))


def step_figure(index: RunIndex, *, max_points: int = DEFAULT_MAX_POINTS, unit: tuple[str, int] | None = None,
                rank: int | None = None, max_ranks: int = DEFAULT_MAX_RANKS) -> go.Figure:
    """Per step: the step peak stacked by category, allocator lines, deep / aborted markers.
    One set of traces per rank (``meta`` = {"rank": r}); a menu shows one rank at a time. Of
    more than ``max_ranks`` ranks, the highest-peak ones are drawn (:func:`drawn_ranks`)."""
    go_mod = _plotly()
    shown = rank if rank is not None else index.ranks[0]
    ranks = drawn_ranks(index, shown, max_ranks)
    unit = unit or pick_unit(_max_plotted(index))
    uname, scale = unit
    fig = go_mod.Figure()
    spans: dict[int, tuple[int, int]] = {}
    for rk in ranks:
        series = index.series[rk]
        dev = index.device(rk)
        peaks = series.totals(dev)
        idx = np.array(downsample(peaks, series.deep | series.aborted, max_points), dtype=np.int64)
        xs = series.steps[idx]
        first = len(fig.data)
        visible = rk == shown
        meta = {"rank": rk, "device": dev}
        for cat in CATEGORIES:
            ys = series.category(dev, cat)[idx].astype(np.float64) / scale
            if not ys.any():
                continue
            fig.add_scatter(x=xs, y=ys, name=cat, stackgroup=f"r{rk}", mode="lines", line={"width": 0.5},
                            fillcolor=CATEGORY_COLORS[cat], line_color=CATEGORY_COLORS[cat], legendgroup=cat,
                            visible=visible, meta={**meta, "kind": "category", "category": cat},
                            hovertemplate=f"step %{{x}}<br>{cat}: %{{y:.4~f}} {uname}<extra>rank {rk}</extra>")
        for label, keys in allocator_series(dev):
            col = allocator_column(series, dev, keys)
            if col is None or np.isnan(col[idx]).all():
                continue
            fig.add_scatter(x=xs, y=col[idx] / scale, name=label, mode="lines", visible=visible,
                            line={"width": 1.5, "dash": "dot" if "allocated" in label else "solid",
                                  "color": "#222" if "allocated" in label else "#777"},
                            meta={**meta, "kind": "allocator", "keys": keys},
                            hovertemplate=f"step %{{x}}<br>{label}: %{{y:.4~f}} {uname}<extra>rank {rk}</extra>")
        deep = idx[series.deep[idx]]
        if len(deep):
            fig.add_scatter(x=series.steps[deep].tolist(), y=(peaks[deep] / scale).tolist(), mode="markers",
                            name="deep step", visible=visible, meta={**meta, "kind": "deep"},
                            marker={"symbol": "diamond", "size": 6, "color": DEEP_COLOR},
                            hovertemplate=f"deep step %{{x}}: peak %{{y:.4~f}} {uname}<extra>rank {rk}</extra>")
        aborted = idx[series.aborted[idx]]
        if len(aborted):
            fig.add_scatter(x=series.steps[aborted].tolist(), y=(peaks[aborted] / scale).tolist(),
                            mode="markers", name="aborted step", visible=visible, meta={**meta, "kind": "aborted"},
                            text=[_abort_text(series.aborts[int(st)]) for st in series.steps[aborted]],
                            marker={"symbol": "x", "size": 11, "color": ABORT_COLOR, "line": {"width": 1}},
                            hovertemplate="%{text}<br>peak %{y:.4~f} " + uname + f"<extra>rank {rk}</extra>")
        spans[rk] = (first, len(fig.data))
    n = len(fig.data)
    menus: list[dict[str, Any]] = []
    tracked = _max_tracked(index) / scale
    everything = _max_plotted(index) / scale
    if tracked > 0 and everything > 5 * tracked:
        # e.g. the host's RSS (interpreter, libraries) dwarfs what the tracker counts: zoom on the stack
        fit = [0, tracked * 1.15]
        fig.update_yaxes(range=fit)
        menus.append({"type": "buttons", "direction": "right", "x": 0.45, "y": 1.15, "xanchor": "left",
                      "yanchor": "top", "active": 0, "buttons": [
                          {"label": "fit tracked peak", "method": "relayout", "args": [{"yaxis.range": fit}]},
                          {"label": "fit all lines", "method": "relayout",
                           "args": [{"yaxis.range": [0, everything * 1.05]}]}]})
    if len(ranks) > 1:
        buttons = [
            {"label": f"rank {rk}", "method": "update",
             "args": [{"visible": [spans[rk][0] <= i < spans[rk][1] for i in range(n)]},
                      {"title.text": f"Step peak by category, rank {rk}"}]}
            for rk in ranks
        ]
        menus.append({"buttons": buttons, "active": ranks.index(shown), "x": 1.0, "y": 1.15, "xanchor": "right",
                      "yanchor": "top"})
    if menus:
        fig.update_layout(updatemenus=menus)
    fig.update_layout(title=f"Step peak by category, rank {shown}", xaxis_title="step",
                      yaxis_title=f"memory ({uname})", hovermode="closest", template="plotly_white", height=520,
                      legend={"groupclick": "toggleitem"}, meta={"unit": uname, "scale": scale})
    return fig


def _max_tracked(index: RunIndex) -> float:
    return float(max((_rank_peak(index, rk) for rk in index.ranks), default=0))


def _max_plotted(index: RunIndex) -> float:
    best = _max_tracked(index)
    for rk in index.ranks:
        dev = index.device(rk)
        for _, keys in allocator_series(dev):
            col = allocator_column(index.series[rk], dev, keys)
            if col is not None:
                finite = col[np.isfinite(col)]
                if len(finite):
                    best = max(best, float(finite.max()))
    return best


@dataclass
class Snapshot:
    """One bar of a module view."""

    label: str
    module: str
    state: str
    call: int
    breakdown: dict[str, int]
    forward: bool


def module_snapshots(report: StepReport, device: str) -> list[Snapshot]:
    """Every (module, state, call) snapshot on ``device`` in execution order: by snapshot time,
    ties by module order then state order; without times, forward states in module order
    followed by backward states in reverse module order."""
    order = {m: i for i, m in enumerate(report.module_order)}
    state_ix = {s: i for i, s in enumerate(STATES)}
    rows: list[tuple[tuple[Any, ...], Snapshot]] = []
    multi = {(m, s) for m, mr in report.modules.items() for s, calls in mr.snapshots.items() if len(calls) > 1}
    for m, mr in report.modules.items():
        for s, calls in mr.snapshots.items():
            times = mr.times.get(s, [])
            for c, b in enumerate(calls):
                fwd = s in _FWD
                label = f"{m} · {s}" + (f" #{c + 1}" if (m, s) in multi else "")
                snap = Snapshot(label, m, s, c, dict(b.get(device, {})), fwd)
                mo = order.get(m, len(order))
                if c < len(times) and times[c]:
                    key: tuple[Any, ...] = (0, times[c], mo, state_ix.get(s, 99), c)
                else:
                    key = (1, 0 if fwd else 1, mo if fwd else -mo, c, state_ix.get(s, 99))
                rows.append((key, snap))
    rows.sort(key=lambda kv: kv[0])
    return [s for _, s in rows]


def module_figure(report: StepReport, *, device: str | None = None, unit: tuple[str, int] | None = None,
                  title: str = "") -> go.Figure:
    """Module snapshots of one step in execution order, stacked by category (see module doc)."""
    go_mod = _plotly()
    dev = device or main_device([report])
    snaps = module_snapshots(report, dev)
    abort = report.aborted
    if abort is not None:
        where = f"{abort.module or '?'} · {abort.state or '?'}"
        snaps.append(Snapshot(f"ABORT {('OOM' if abort.oom else abort.error)} @ {where}", abort.module, abort.state,
                              0, dict(abort.breakdown.get(dev, {})), abort.state in _FWD or not snaps
                              or snaps[-1].forward))
    biggest = max((s.breakdown.get(TOTAL, 0) for s in snaps), default=0)
    uname, scale = unit or pick_unit(biggest)
    labels = [s.label for s in snaps]
    fig = go_mod.Figure()
    for cat in CATEGORIES:
        ys = np.array([s.breakdown.get(cat, 0) for s in snaps], dtype=np.float64) / scale
        if not ys.any():
            continue
        fig.add_bar(x=labels, y=ys, name=cat, marker_color=CATEGORY_COLORS[cat], meta={"category": cat},
                    hovertemplate=f"%{{x}}<br>{cat}: %{{y:.4~f}} {uname}<extra></extra>")
    shapes, notes = [], []
    bwd = next((i for i, s in enumerate(snaps) if not s.forward), None)
    if bwd is not None and bwd > 0:
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": bwd - 0.5, "x1": bwd - 0.5, "y0": 0,
                       "y1": 1, "line": {"dash": "dash", "color": "#555"}})
        notes.append({"x": bwd - 0.5, "y": 1.02, "xref": "x", "yref": "paper", "text": "backward →",
                      "showarrow": False, "xanchor": "left"})
    if abort is not None and snaps:
        last = len(snaps) - 1
        fig.add_scatter(x=[labels[last]], y=[snaps[last].breakdown.get(TOTAL, 0) / scale], mode="markers+text",
                        marker={"symbol": "x", "size": 14, "color": ABORT_COLOR}, name="stopped here",
                        text=["stopped here"], textposition="top center", meta={"kind": "aborted"},
                        hovertext=[_abort_text(report)], hoverinfo="text")
    fig.update_layout(barmode="stack", title=title, template="plotly_white", height=560, shapes=shapes,
                      annotations=notes, yaxis_title=f"memory on {dev} ({uname})", bargap=0.05,
                      xaxis={"type": "category", "tickangle": -60, "automargin": True},
                      meta={"unit": uname, "scale": scale, "rank": report.rank, "step": report.step, "device": dev})
    return fig


def module_peaks(report: StepReport, device: str) -> dict[str, int]:
    """module -> largest ``total`` on ``device`` over its states and calls."""
    return {
        m: max((b.get(device, {}).get(TOTAL, 0) for calls in mr.snapshots.values() for b in calls), default=0)
        for m, mr in report.modules.items()
    }


def heatmap_figure(index: RunIndex, steps: Sequence[tuple[str, int]],
                   unit: tuple[str, int] | None = None, progress: Progress = quiet) -> go.Figure:
    """rank x module per-module peak for each (label, step); a menu switches between steps."""
    go_mod = _plotly()
    ranks = index.ranks
    devices = {rk: index.device(rk) for rk in ranks}
    uname, scale = unit or pick_unit(_max_tracked(index))
    fig = go_mod.Figure()
    every = max(1, len(ranks) // 8)
    for n, (label, step) in enumerate(steps):
        modules: list[str] = []
        per_rank: dict[int, dict[str, int]] = {}
        for i, rk in enumerate(ranks):
            if len(ranks) > 64 and i % every == 0:
                progress(f"heatmap {label}: module detail of rank {rk} ({i + 1} of {len(ranks)})")
            full = index.full(rk, step)
            if full is None:
                continue
            per_rank[rk] = module_peaks(full, devices[rk])
            for m in full.module_order or list(full.modules):
                if m not in modules:
                    modules.append(m)
            for m in full.modules:
                if m not in modules:
                    modules.append(m)
        z = [[(per_rank[rk][m] / scale if m in per_rank.get(rk, {}) else None) for m in modules] for rk in ranks]
        fig.add_heatmap(z=z, x=modules, y=[f"rank {rk}" for rk in ranks], colorscale="Viridis", visible=n == 0,
                        colorbar={"title": {"text": uname}}, name=label, meta={"step": step, "label": label},
                        hovertemplate=f"%{{y}} %{{x}}<br>module peak %{{z:.4~f}} {uname}<extra>step {step}</extra>")
    if len(steps) > 1:
        fig.update_layout(updatemenus=[{
            "buttons": [{"label": label, "method": "update",
                         "args": [{"visible": [i == k for i in range(len(steps))]},
                                  {"title.text": f"Per-module peak, rank x module: {label}"}]}
                        for k, (label, _) in enumerate(steps)],
            "x": 1.0, "y": 1.18, "xanchor": "right", "yanchor": "top"}])
    first = steps[0][0] if steps else ""
    fig.update_layout(title=f"Per-module peak, rank x module: {first}", template="plotly_white",
                      height=max(320, 60 + 28 * len(ranks)),
                      xaxis={"type": "category", "tickangle": -60, "automargin": True},
                      yaxis={"type": "category", "autorange": "reversed"}, meta={"unit": uname, "scale": scale})
    return fig


def step_matrix(index: RunIndex) -> tuple[np.ndarray, np.ndarray]:
    """(steps seen on any rank, ranks x steps matrix of the step peak on each rank's main device,
    NaN where a rank has no report of that step); rows in ``index.ranks`` order."""
    ranks = index.ranks
    steps = np.unique(np.concatenate([index.series[rk].steps for rk in ranks])) if ranks else np.zeros(0, np.int64)
    m = np.full((len(ranks), len(steps)), np.nan)
    for i, rk in enumerate(ranks):
        series = index.series[rk]
        m[i, np.searchsorted(steps, series.steps)] = series.totals(index.device(rk))
    return steps, m


def rank_skew(index: RunIndex) -> tuple[list[int], list[int], list[str]]:
    """(steps, max - min step peak across ranks, hover text) for steps seen on 2+ ranks; ties
    name the highest rank for the max and the lowest for the min."""
    ranks = np.array(index.ranks)
    steps, m = step_matrix(index)
    cols = np.flatnonzero((~np.isnan(m)).sum(axis=0) >= 2)
    if not len(cols):
        return [], [], []
    sub = m[:, cols]
    counts = (~np.isnan(sub)).sum(axis=0)
    hi_row = len(ranks) - 1 - np.nanargmax(sub[::-1], axis=0)
    lo_row = np.nanargmin(sub, axis=0)
    at = np.arange(len(cols))
    skew = (sub[hi_row, at] - sub[lo_row, at]).astype(np.int64)
    text = [f"max rank {ranks[h]}, min rank {ranks[lo]} ({c} ranks)" for h, lo, c in zip(hi_row, lo_row, counts,
                                                                                        strict=True)]
    return steps[cols].tolist(), skew.tolist(), text


def fleet_figure(index: RunIndex, *, max_points: int = DEFAULT_MAX_POINTS,
                 unit: tuple[str, int] | None = None) -> go.Figure:
    """Per step, the highest, median and lowest step peak across all ranks (each rank on its
    main device), with the rank holding the highest; downsampled like the per-step chart."""
    go_mod = _plotly()
    ranks = np.array(index.ranks)
    steps, m = step_matrix(index)
    present = ~np.isnan(m)
    hi_row = np.nanargmax(np.where(present, m, -np.inf), axis=0)
    at = np.arange(len(steps))
    hi = m[hi_row, at]
    special = np.zeros(len(steps), bool)
    for rk in index.ranks:
        series = index.series[rk]
        special[np.searchsorted(steps, series.steps[series.deep | series.aborted])] = True
    idx = np.array(downsample(hi, special, max_points), dtype=np.int64)
    uname, scale = unit or pick_unit(float(np.nanmax(hi, initial=0)))
    xs = steps[idx]
    fig = go_mod.Figure()
    fig.add_scatter(x=xs, y=np.nanmin(m[:, idx], axis=0) / scale, mode="lines", name="lowest rank",
                    line={"color": "#2CA02C"}, hovertemplate=f"step %{{x}}: lowest %{{y:.4~f}} {uname}<extra></extra>")
    fig.add_scatter(x=xs, y=np.nanmedian(m[:, idx], axis=0) / scale, mode="lines", name="median rank",
                    line={"color": "#1F77B4"}, hovertemplate=f"step %{{x}}: median %{{y:.4~f}} {uname}<extra></extra>")
    fig.add_scatter(x=xs, y=hi[idx] / scale, mode="lines", name="highest rank", line={"color": ABORT_COLOR},
                    text=[f"rank {ranks[r]} ({int(c)} ranks reported)" for r, c in
                          zip(hi_row[idx], present[:, idx].sum(axis=0), strict=True)],
                    hovertemplate=f"step %{{x}}: highest %{{y:.4~f}} {uname}, %{{text}}<extra></extra>")
    fig.update_layout(title=f"Step peak across all {len(ranks)} ranks: highest, median, lowest", xaxis_title="step",
                      yaxis_title=f"memory ({uname})", template="plotly_white", height=420,
                      meta={"unit": uname, "scale": scale})
    return fig


def skew_figure(index: RunIndex, *, max_points: int = DEFAULT_MAX_POINTS,
                unit: tuple[str, int] | None = None) -> go.Figure:
    go_mod = _plotly()
    steps, skew, text = rank_skew(index)
    special = {int(st) for series in index.series.values() for st in series.steps[series.deep | series.aborted]}
    idx = downsample(skew, [s in special for s in steps], max_points)
    uname, scale = unit or pick_unit(max(skew, default=0))
    fig = go_mod.Figure()
    fig.add_scatter(x=np.array([steps[i] for i in idx], dtype=np.int64),
                    y=np.array([skew[i] for i in idx], dtype=np.float64) / scale, mode="lines", name="rank skew",
                    text=[text[i] for i in idx], line={"color": "#1F77B4"}, fill="tozeroy",
                    hovertemplate=f"step %{{x}}: max - min = %{{y:.4~f}} {uname}<br>%{{text}}<extra></extra>")
    fig.update_layout(title="Rank skew: max - min of the step peak across ranks", xaxis_title="step",
                      yaxis_title=f"skew ({uname})", template="plotly_white", height=360,
                      meta={"unit": uname, "scale": scale})
    return fig


# -- page ----------------------------------------------------------------------------------------
@dataclass
class Selection:
    """The steps the module views and heatmaps show."""

    rank: int
    step: int
    worst_rank: int
    worst_step: int
    worst_peak: int


def select_steps(index: RunIndex, step: int | None = None, rank: int | None = None) -> Selection:
    """Highest-peak (rank, step) over the run (ties: the lower rank, then the earlier step), and
    the chosen step (default: the chosen rank's last step; the chosen rank defaults to the one
    holding the highest peak)."""
    if not index.series:
        raise ValueError("no step reports")
    worst: tuple[int, int, int] | None = None
    for rk in index.ranks:
        series = index.series[rk]
        totals = series.totals(index.device(rk))
        i = int(np.argmax(totals))  # the first of equal maxima: the earliest step
        cand = (int(totals[i]), -rk, -int(series.steps[i]))
        if worst is None or cand > worst:
            worst = cand
    assert worst is not None
    wpeak, wrank, wstep = worst[0], -worst[1], -worst[2]
    if rank is None:
        rank = wrank
    elif rank not in index.series:
        raise ValueError(f"--rank {rank}: no reports for that rank; ranks present: {index.ranks}")
    steps = index.series[rank].steps
    if step is None:
        step = int(steps[-1])
    elif index.series[rank].row(step) is None:
        raise ValueError(f"--step {step}: rank {rank} has no report for it; its steps run {steps[0]}..{steps[-1]}")
    return Selection(rank, step, wrank, wstep, wpeak)


@dataclass
class Report:
    """The figures of a page, in page order, with what the page says about them."""

    figures: list[tuple[str, str, go.Figure]]  # (id, caption, figure)
    summary: list[tuple[str, str]]
    aborted: list[tuple[int, str]]  # (rank, text)
    #: the leak and forecast sections (``trends_html``), between the summary and the charts
    sections: list[Section] = field(default_factory=list)


def build_report(index: RunIndex, *, step: int | None = None, rank: int | None = None,
                 max_points: int = DEFAULT_MAX_POINTS, progress: Progress = quiet,
                 max_ranks: int = DEFAULT_MAX_RANKS, trends: dict[int, RankTrend] | None = None,
                 capacity: int | None = None) -> Report:
    """All figures of the page (see the module doc). ``trends``: each rank's step-level figures
    over time (:func:`scan_run`; default: from the complete reports of ``RunIndex.of``), for the
    leak and forecast sections; ``capacity``: bytes to forecast against on every rank (default:
    each CUDA device's own)."""
    sel = select_steps(index, step, rank)
    unit = pick_unit(_max_plotted(index))
    tunit = pick_unit(_max_tracked(index))  # module views and heatmaps: no allocator lines there
    n_steps = index.reports_total
    longest = max(len(v) for v in index.series.values())
    progress(f"drawing per-step chart ({n_steps} reports, {len(index.ranks)} ranks)")
    figures: list[tuple[str, str, go.Figure]] = []
    ds = (f"{longest} steps drawn whole" if longest <= max_points else
          f"downsampled: {longest} steps cut into {max_points} runs, each drawn by its highest-peak step, "
          "plus every deep and aborted step")
    drawn = drawn_ranks(index, sel.rank, max_ranks)
    which = "" if len(drawn) == len(index.ranks) else (
        f" Drawn for {len(drawn)} of {len(index.ranks)} ranks (the highest step peaks, and rank {sel.rank}); "
        "the fleet chart below covers all.")
    figures.append(("steps", f"Step peak stacked by category, with the allocator on the same axis ({ds}). "
                    f"◆ deep step, ✕ aborted step (hover: module and state where it stopped).{which}",
                    step_figure(index, max_points=max_points, unit=unit, rank=sel.rank, max_ranks=max_ranks)))
    progress(f"reading module detail: step {sel.step} (rank {sel.rank}), highest peak step {sel.worst_step} "
             f"(rank {sel.worst_rank})")
    views = [("selected", sel.rank, sel.step, "selected step" if step is not None else "last step")]
    if (sel.worst_rank, sel.worst_step) != (sel.rank, sel.step):
        views.append(("worst", sel.worst_rank, sel.worst_step, "highest peak"))
    else:
        views[0] = ("selected", sel.rank, sel.step, views[0][3] + ", also the highest peak")
    for vid, rk, st, what in views:
        full = index.full(rk, st)
        if full is None or not full.modules:
            continue
        dev = index.device(rk)
        title = f"Modules through forward and backward: step {st}, rank {rk} ({what})"
        figures.append((f"modules-{vid}", "Each module's memory at each FSDP state, in execution order, stacked "
                        "by category.", module_figure(full, device=dev, unit=tunit, title=title)))
    if len(index.ranks) > 1:
        progress("drawing cross-rank charts")
        if len(drawn) < len(index.ranks):
            figures.append(("fleet", "Every rank's step peak, per step: the highest (hover: which rank), the "
                            "median and the lowest.", fleet_figure(index, max_points=max_points, unit=tunit)))
        hsteps = [(f"step {sel.worst_step} (highest peak)", sel.worst_step)]
        if sel.step != sel.worst_step:
            hsteps.append((f"step {sel.step} (selected)", sel.step))
        figures.append(("heatmap", "Per-module peak (largest total over its states) on every rank, same step.",
                        heatmap_figure(index, hsteps, unit=tunit, progress=progress)))
        figures.append(("skew", "How far apart the ranks' step peaks are, per step.",
                        skew_figure(index, max_points=max_points)))
    aborted = [(rk, _abort_text(a)) for rk in index.ranks for _, a in sorted(index.series[rk].aborts.items())]
    first = index.series[index.ranks[0]]
    deep = sum(int(v.deep.sum()) for v in index.series.values())
    devices = sorted({index.device(rk) for rk in index.ranks})
    summary = [
        ("ranks", _rank_list(index.ranks) + f" (world size {first.world_size})"),
        ("steps", f"{min(int(v.steps[0]) for v in index.series.values())}.."
                  f"{max(int(v.steps[-1]) for v in index.series.values())}"
                  f", {n_steps} reports ({deep} deep, {len(aborted)} aborted)"),
        ("devices", ", ".join(devices) if len(devices) <= 16 else
         f"{len(devices)} devices: {', '.join(devices[:8])}, ..."),
        ("FSDP", str(first.fsdp_version)),
        ("highest step peak", f"{sel.worst_peak / tunit[1]:.4g} {tunit[0]} at step {sel.worst_step}, "
                              f"rank {sel.worst_rank}"),
    ]
    if index.duplicates:
        summary.append(("duplicates", f"{index.duplicates} (rank, step) reports seen twice; the later one kept"))
    sections = trend_sections(index, trends, capacity, progress)
    summary += [(s.id, s.summary) for s in sections if s.summary]
    return Report(figures, summary, aborted, sections)


def trend_sections(index: RunIndex, trends: dict[int, RankTrend] | None, capacity: int | None,
                   progress: Progress = quiet) -> list[Section]:
    """The leak and forecast sections (none where the run's trends are not at hand)."""
    if trends is None:
        complete = [r for s in index.series.values() for r in s.complete.values()]
        if len(complete) != index.reports_total:
            return []
        trends = TrendBuilder.of(complete)
    progress("looking for leaks and fitting forecasts")
    ranks = [rk for rk in index.ranks if rk in trends]
    leaks = leak_section([trends_mod.find_leaks(trends[rk]) for rk in ranks], trends, CATEGORY_COLORS)
    forecasts = [trends_mod.forecast(trends[rk], index.device(rk), capacity) for rk in ranks]
    return [leaks, forecast_section(forecasts, trends, capacity_given=capacity)]


def _rank_list(ranks: list[int]) -> str:
    """"0, 1, 2" or, for runs of consecutive ranks, "0..1023"."""
    runs: list[str] = []
    start = prev = None
    for rk in [*ranks, None]:
        if rk is not None and prev is not None and rk == prev + 1:
            prev = rk
            continue
        if start is not None:
            pair = f"{start}, {prev}" if prev == start + 1 else f"{start}..{prev}"
            runs.append(str(start) if start == prev else pair)
        start = prev = rk
    return ", ".join(runs)


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1400px;
       color: #222; background: #fff; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
table.summary td { padding: 2px 12px 2px 0; vertical-align: top; }
table.summary td:first-child { color: #666; }
section { margin-top: 28px; }
p.caption { color: #555; margin: 4px 0; }
ul.aborted { color: #b00; }
table.trend { border-collapse: collapse; margin: 8px 0; }
table.trend th, table.trend td { border-bottom: 1px solid #ddd; padding: 3px 12px 3px 0; text-align: left; }
p.leak { color: #b00; font-weight: 600; }
p.ok { color: #1a7f37; }
"""


def render_html(report: Report, title: str = "FSDP memory report", extra_html: str = "") -> str:
    """One self-contained page: plotly.js and CSS inlined, no external fetches. ``extra_html``
    (trusted, already escaped: the baseline comparison) goes under the summary."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>", f"<style>{_CSS}</style>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>', "</head><body>",
        f"<h1>{html.escape(title)}</h1>", '<table class="summary">',
    ]
    parts += [f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in report.summary]
    parts.append("</table>")
    if extra_html:
        parts.append(extra_html)
    if report.aborted:
        shown = report.aborted[:50]
        parts.append(f"<section><h2>Aborted steps ({len(report.aborted)})</h2><ul class=\"aborted\">")
        parts += [f"<li>rank {rk}: {html.escape(text)}</li>" for rk, text in shown]
        if len(report.aborted) > len(shown):
            parts.append(f"<li>... and {len(report.aborted) - len(shown)} more (all marked in the charts)</li>")
        parts.append("</ul></section>")
    for sec in report.sections:
        parts.append(f'<section id="{sec.id}"><h2>{html.escape(sec.title)}</h2>{sec.html}')
        for fid, caption, fig in sec.figures:
            div = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=f"fig-{fid}",
                              config=_PLOTLY_CONFIG)
            parts.append(f'<p class="caption">{html.escape(caption)}</p>{div}')
        parts.append("</section>")
    for fid, caption, fig in report.figures:
        div = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=f"fig-{fid}", config=_PLOTLY_CONFIG)
        parts.append(f'<section id="{fid}"><p class="caption">{html.escape(caption)}</p>{div}</section>')
    parts.append("</body></html>")
    return "\n".join(parts)


def scan_run(paths: Sequence[str], progress: Progress = quiet) -> tuple[RunIndex, dict[int, RankTrend]]:
    """:func:`scan_files`, and from the same reading each rank's step-level figures over time
    (``trends.RankTrend``: step-end bytes, timestamps, leak reports) for the leak and forecast sections."""
    trends = TrendBuilder()
    index = scan_files(paths, progress, observe=trends.add)
    return index, trends.build()


def write_report(paths: Sequence[str], out: str, *, step: int | None = None, rank: int | None = None,
                 max_points: int = DEFAULT_MAX_POINTS, progress: Progress = quiet,
                 baseline: Sequence[str] | None = None, max_ranks: int = DEFAULT_MAX_RANKS,
                 capacity: int | None = None) -> int:
    """Read ``paths``, write the page to ``out`` (parents created); returns its size in bytes.
    ``baseline``: another run's (or an estimate's) JSONL, compared with this run in a section
    (``fsdp_mem_otel.offline.compare``; rank ``rank`` or 0, step ``step`` or each run's last deep step).
    ``capacity``: bytes the forecast section forecasts against (default: each CUDA device's own)."""
    index, trends = scan_run(paths, progress)
    progress(f"read {index.reports_total} step reports of {len(index.ranks)} ranks "
             f"({sum(s.nbytes for s in index.series.values()) / 1e6:.1f} MB of step series)")
    report = build_report(index, step=step, rank=rank, max_points=max_points, progress=progress,
                          max_ranks=max_ranks, trends=trends, capacity=capacity)
    extra = ""
    if baseline:
        from fsdp_mem_otel.offline.compare import compare, load_profile, render_html_section

        progress(f"comparing with {', '.join(baseline)}")
        r = rank or 0
        extra = render_html_section(compare(load_profile(list(baseline), step=step, rank=r),
                                            load_profile(list(paths), step=step, rank=r)))
    progress("rendering HTML")
    text = render_html(report, title=f"FSDP memory report: {', '.join(os.path.basename(p) for p in paths)}",
                       extra_html=extra)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    data = text.encode("utf-8")
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out)
    return len(data)


# -- command line --------------------------------------------------------------------------------
_positive = int_at_least(1)
_non_negative = int_at_least(0)


def _size(text: str) -> int:
    """An argparse ``type``: a byte count such as 80GiB (``trends.parse_size``)."""
    try:
        return trends_mod.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def report_main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(
        prog="fsdp-mem-otel report",
        description="Turn the tracker's JSONL files (one or more, any ranks; rotated files are read with "
                    "their base name) into one self-contained HTML page of charts.",
    )
    p.add_argument("paths", nargs="+", metavar="RUN.jsonl", help="JSONL files written by JSONLExporter")
    p.add_argument("-o", "--output", required=True, metavar="REPORT.html",
                   help="the HTML file to write (missing parent directories are created)")
    p.add_argument("--step", type=_non_negative, default=None,
                   help="step whose per-module view is drawn (default: the last step)")
    p.add_argument("--rank", type=_non_negative, default=None,
                   help="rank shown first and used for --step (default: the rank with the highest peak)")
    p.add_argument("--max-points", type=_positive, default=DEFAULT_MAX_POINTS,
                   help=f"per-step charts draw every step up to this many, else downsample (default "
                        f"{DEFAULT_MAX_POINTS})")
    p.add_argument("--max-ranks", type=_positive, default=DEFAULT_MAX_RANKS,
                   help=f"the per-step chart draws this many ranks, those with the highest step peaks (default "
                        f"{DEFAULT_MAX_RANKS}); a chart of every rank's highest, median and lowest peak covers "
                        "the rest")
    p.add_argument("--baseline", nargs="+", metavar="BASE.jsonl", default=None,
                   help="another run's (or an estimate's) JSONL: a section says what grew from it to this run, "
                        "per category and per module (as `fsdp-mem-otel compare`)")
    p.add_argument("--capacity", type=_size, default=None, metavar="SIZE",
                   help="forecast when each rank reaches this many bytes (80GiB, 80GB = 10^9 bytes, or a byte "
                        "count): for a CPU run, or what-if on another GPU (default: each CUDA device's total "
                        "memory; none on CPU)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    for path in [*args.paths, *(args.baseline or [])]:
        if os.path.isdir(path):
            p.error(f"argument RUN.jsonl: {path} is a directory; give the JSONL files in it")
        if not rotated_files(path):
            p.error(f"argument RUN.jsonl: {path}: no such file (nor rotated {path}.N)")
    if os.path.isdir(args.output):
        p.error(f"argument -o/--output: {args.output} is a directory; give a file name such as report.html")
    out_parent = os.path.dirname(os.path.abspath(args.output))
    blocker = out_parent
    while blocker and not os.path.exists(blocker):
        blocker = os.path.dirname(blocker)
    if blocker and not os.path.isdir(blocker):
        p.error(f"argument -o/--output: cannot create {out_parent}: {blocker} is a file")
    from fsdp_mem_otel.cli_errors import check_writable

    for path in args.paths:
        check_step_report_file(path, "RUN.jsonl")
    for path in args.baseline or []:
        check_step_report_file(path, "--baseline")
    check_writable(args.output, "-o/--output")

    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[report {time.perf_counter() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)

    if not os.path.isdir(out_parent):
        progress(f"creating directory {out_parent}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            size = write_report(args.paths, args.output, step=args.step, rank=args.rank,
                                max_points=args.max_points, progress=progress, baseline=args.baseline,
                                max_ranks=args.max_ranks, capacity=args.capacity)
        for w in caught[:20]:
            print(f"fsdp-mem-otel report: warning: {w.message}", file=sys.stderr)
        if len(caught) > 20:
            print(f"fsdp-mem-otel report: ... {len(caught) - 20} more warnings", file=sys.stderr)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"fsdp-mem-otel report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fsdp-mem-otel report: error: {exc}", file=sys.stderr)
        return 1
    progress(f"wrote {args.output} ({size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    from fsdp_mem_otel.cli_errors import run_command

    raise SystemExit(run_command("fsdp-mem-otel report", report_main, sys.argv[1:]))
