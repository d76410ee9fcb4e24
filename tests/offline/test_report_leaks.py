"""The report's leak and forecast sections.

Leaks: real 2-rank runs of the demo (``fsdp-mem-otel demo --leak``, FSDP1 and FSDP2, and one
without the leak), rendered by the report; the oracle is the JSONL text parsed with ``json``: the
categories and modules its last leak reports name, and the growth recomputed here with
``numpy.polyfit`` on the step-end bytes. Forecast: synthetic runs whose hours to capacity are hand
arithmetic (steady growth), or which must give none (a plateau after a warm-up, the step-1 jump).
The page's figures are read back from its ``data-*`` attributes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fsdp_mem_otel.offline import trends
from fsdp_mem_otel.offline.report import RunIndex, build_report, render_html, report_main
from fsdp_mem_otel.offline.trends import TrendBuilder, find_leaks, growing_verdicts, parse_size
from fsdp_mem_otel.offline.trends_html import hours_text
from fsdp_mem_otel.schema import CATEGORIES, CATEGORY_KEYS, TOTAL, StepAbort, StepReport
from tests.offline.test_report import page_figures

REPO = Path(__file__).resolve().parents[2]
GiB, MiB = 1 << 30, 1 << 20
STEPS = 12  # the detector needs 10 step ends


# -- reading the page back -----------------------------------------------------------------------
class _Rows(HTMLParser):
    """The data-* attributes of every <tr> of the table with the given id."""

    def __init__(self, table_id: str) -> None:
        super().__init__()
        self.table_id = table_id
        self.inside = False
        self.rows: list[dict[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "table":
            self.inside = a.get("id") == self.table_id
        elif tag == "tr" and self.inside and any(k.startswith("data-") for k in a):
            self.rows.append({k[5:]: v for k, v in a.items() if k.startswith("data-")})

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self.inside = False


def table_rows(text: str, table_id: str) -> list[dict[str, str]]:
    p = _Rows(table_id)
    p.feed(text)
    return p.rows


def section(text: str, sid: str) -> str:
    start = text.index(f'<section id="{sid}">')
    return text[start:text.index("</section>", start)]


def run_report(files: list[Path], out: Path, *extra: str) -> str:
    assert report_main([*map(str, files), "-o", str(out), "-q", *extra]) == 0
    return out.read_text()


# -- real runs of the demo -----------------------------------------------------------------------
def demo_run(tmp_path: Path, *flags: str) -> tuple[list[Path], list[dict[str, Any]]]:
    """``fsdp-mem-otel demo`` on 2 gloo ranks, its JSONL files and their lines (parsed with json)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_MEM_OTEL_", "OTEL_"))}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-m", "fsdp_mem_otel", "demo", "--steps", str(STEPS), "--blocks", "2",
                           "--width", "16", "--batch", "4", "--out", str(out), *flags],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    files = [tmp_path / f"run.rank{r}.jsonl" for r in (0, 1)]
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    assert len(lines) == 2 * STEPS
    return files, lines


def step_end(lines: list[dict[str, Any]], rank: int, category: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, step-end bytes of ``category`` summed over devices) of one rank, by step."""
    mine = sorted((d for d in lines if d["rank"] == rank), key=lambda d: d["step"])
    return (np.array([d["step"] for d in mine], np.float64),
            np.array([sum(c.get(category, 0) for c in d["current"].values()) for d in mine], np.float64))


@pytest.mark.parametrize("fsdp", ["1", "2"])
def test_demo_leak_is_named_with_its_growth_and_holders(tmp_path: Path, fsdp: str) -> None:
    files, lines = demo_run(tmp_path, "--leak", "--fsdp", fsdp)
    text = run_report(files, tmp_path / "report.html")
    leaks = section(text, "leaks")
    assert "No leak found" not in leaks
    rows = table_rows(text, "leak-table")
    held = table_rows(text, "held-table")
    for rk in (0, 1):
        last = max((d for d in lines if d["rank"] == rk), key=lambda d: d["step"])
        growing = last["leak"]["growing"]
        assert {"activation", TOTAL} <= set(growing)  # the kept graphs' saved activations
        mine = {r["category"]: r for r in rows if r["rank"] == str(rk)}
        assert set(mine) == set(growing)
        for cat, row in mine.items():
            steps, ys = step_end(lines, rk, cat)
            window = int(row["window"])
            assert window == 30 and len(steps) < window  # the whole run is in the window
            expect = np.polyfit(steps[-window:], ys[-window:], 1)[0]
            assert float(row["fitted"]) == pytest.approx(expect, rel=1e-9)
            assert float(row["detector"]) == growing[cat]  # the tracker's own figure, as written
            assert float(row["fitted"]) == pytest.approx(growing[cat], rel=1e-9)  # same rule, same answer
            assert int(row["detector-step"]) == STEPS
            named = [d["step"] for d in lines if d["rank"] == rk and d["leak"] and cat in d["leak"]["growing"]]
            assert int(row["detector-since"]) == min(named) == 10
            assert int(row["since"]) == int(steps[1 + int(np.flatnonzero(np.diff(ys) > 0)[0])])
            assert int(row["now"]) == ys[-1]
        # the modules holding bytes at the last step's end: those its leak report names, same bytes
        assert {r["module"]: int(r["bytes"]) for r in held if r["rank"] == str(rk)} == last["leak"]["held"]
        assert last["leak"]["held"]
        for module in last["leak"]["held"]:
            assert module.replace("<", "&lt;").replace(">", "&gt;") in leaks
    # the chart: every plotted step-end value is the JSONL's
    fig = page_figures(text)["fig-leak"]
    scale = fig["layout"]["meta"]["scale"]
    traces = [tr for tr in fig["data"] if tr["meta"]["kind"] == "step_end"]
    assert {(tr["meta"]["rank"], tr["meta"]["category"]) for tr in traces} == {(int(r["rank"]), r["category"])
                                                                             for r in rows}
    for tr in traces:
        steps, ys = step_end(lines, tr["meta"]["rank"], tr["meta"]["category"])
        assert tr["x"] == steps.tolist() and [y * scale for y in tr["y"]] == ys.tolist()

    # the same run against a capacity: hours = (capacity - fitted now) / growth per hour, the sooner
    # of step end and step peak, fitted here with polyfit over time (light steps: the demo runs deep
    # every 5th step, whose peak counts more)
    cap = 64 * MiB
    text = run_report(files, tmp_path / "cap.html", "--capacity", "64MiB")
    fc = {int(r["rank"]): r for r in table_rows(text, "forecast-table")}
    assert set(fc) == {0, 1}
    for rk in (0, 1):
        mine = sorted((d for d in lines if d["rank"] == rk and d["mode"] == "light"), key=lambda d: d["step"])
        t = np.array([d["timestamp"] for d in mine])
        hours = []
        for key in ("current", "peak"):
            ys = np.array([d[key]["cpu"][TOTAL] for d in mine], np.float64)
            slope, icept = np.polyfit(t - t[-1], ys, 1)
            hours.append((cap - icept) / slope / 3600)
        assert int(fc[rk]["capacity"]) == cap
        assert float(fc[rk]["hours"]) == pytest.approx(min(hours), rel=1e-6)
        assert fc[rk]["series"] == ("step_end", "step_peak")[int(np.argmin(hours))]


def test_demo_healthy_run_says_no_leak_and_no_forecast(tmp_path: Path) -> None:
    files, lines = demo_run(tmp_path)
    assert all(d["leak"] is None for d in lines)
    text = run_report(files, tmp_path / "report.html", "--capacity", "80GiB")
    assert f"No leak found over {STEPS} steps" in section(text, "leaks")
    assert table_rows(text, "leak-table") == [] and table_rows(text, "held-table") == []
    # the optimizer state created at step 1 raises step 2's peak; then flat: no forecast
    peaks = sorted((d["step"], d["peak"]["cpu"][TOTAL]) for d in lines if d["rank"] == 0 and d["mode"] == "light")
    assert peaks[1][1] > peaks[0][1] and len({p for _, p in peaks[1:]}) == 1
    assert "Flat: no forecast" in section(text, "forecast") and "data-hours" not in text
    assert "fig-leak" not in text and "fig-forecast" not in text


# -- leaks, synthetic ----------------------------------------------------------------------------
def report_at(step: int, rank: int = 0, *, current: dict[str, int] | None = None, peak_total: int | None = None,
              t: float | None = None, device: str = "cuda:0", capacity: int | None = 80 * GiB,
              mode: str = "light", aborted: bool = False) -> StepReport:
    cur = dict.fromkeys(CATEGORIES, 0) | (current or {})
    cur[TOTAL] = sum(cur[c] for c in CATEGORIES)
    pk = dict.fromkeys(CATEGORIES, 0)
    pk[TOTAL] = cur[TOTAL] if peak_total is None else peak_total
    alloc = {device: {"device_total_bytes": float(capacity)}} if capacity is not None else {}
    abort = StepAbort("OutOfMemoryError", "injected", True, "layers.0", "after_pre_forward", {}) if aborted else None
    return StepReport(step=step, rank=rank, world_size=1, mode=mode, fsdp_version=2, peak={device: pk}, modules={},
                      current={device: cur}, allocator=alloc, timestamp=1.7e9 + (step if t is None else t),
                      aborted=abort)


def write(path: Path, reports: list[StepReport]) -> Path:
    path.write_text("".join(r.to_json() + "\n" for r in reports))
    return path


def test_file_without_leak_reports_gets_the_same_answer(tmp_path: Path) -> None:
    """A file written before the detector (no ``leak`` field): the replayed rule finds the growth."""
    reports = [report_at(s, current={"optimizer_state": 4 * MiB, "activation": 1000 * s + (s % 2)})
               for s in range(1, 41)]
    lines = [json.loads(r.to_json()) for r in reports]
    for d in lines:
        del d["leak"]
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    text = run_report([path], tmp_path / "r.html")
    rows = {r["category"]: r for r in table_rows(text, "leak-table")}
    assert set(rows) == {"activation", TOTAL}
    steps = np.arange(11, 41, dtype=np.float64)  # the last 30 step ends
    expect = np.polyfit(steps, 1000 * steps + steps % 2, 1)[0]
    assert float(rows["activation"]["fitted"]) == pytest.approx(expect, rel=1e-12)
    assert "detector" not in rows["activation"] and int(rows["activation"]["since"]) == 2
    assert "tracker's figure" in text and ">-<" in section(text, "leaks")


def test_growth_that_stopped_is_not_a_leak(tmp_path: Path) -> None:
    reports = [report_at(s, current={"activation": 1000 * min(s, 20)}) for s in range(1, 61)]
    text = run_report([write(tmp_path / "r.jsonl", reports)], tmp_path / "r.html")
    leaks = section(text, "leaks")
    assert "No leak found over 60 steps" in leaks and "data-until" in leaks
    assert re.search(r'data-category="activation"[^>]*data-since="2" data-until="(\d+)"', leaks)


def test_replayed_rule_is_the_detectors() -> None:
    """growing_verdicts / the least-squares slope against training/leaks.py's LeakWatch, on random walks."""
    from fsdp_mem_otel.training.leaks import DEFAULT_MIN_STEPS, DEFAULT_WINDOW, LeakWatch

    assert (trends.LEAK_WINDOW, trends.LEAK_MIN_STEPS) == (DEFAULT_WINDOW, DEFAULT_MIN_STEPS)
    rng = np.random.default_rng(0)
    for trial in range(40):
        window = int(rng.choice([10, 12, 30]))
        n = int(rng.integers(5, 80))
        p_fall = [0.0, 0.02, 0.2][trial % 3]
        moves = rng.choice([-1, 0, 1, 2], size=n, p=[p_fall, 0.5 - p_fall, 0.3, 0.2]) * 512
        ys = (1 << 20) + np.cumsum(moves)
        watch = LeakWatch(window)
        verdicts = growing_verdicts(ys, window)
        for i, y in enumerate(ys):
            got = watch.observe({"cpu": {TOTAL: int(y)}}, {})
            slope = got.growing.get(TOTAL, 0.0) if got is not None else 0.0
            assert (slope > 0) == bool(verdicts[i]), (trial, i)
            if slope > 0:
                lo = max(0, i - window + 1)
                assert trends.least_squares(np.arange(lo, i + 1), ys[lo:i + 1])[0] == pytest.approx(slope)


# -- forecast, synthetic -------------------------------------------------------------------------
def forecast_rows(text: str) -> dict[int, dict[str, str]]:
    return {int(r["rank"]): r for r in table_rows(text, "forecast-table")}


def test_steady_growth_hours_to_capacity(tmp_path: Path) -> None:
    """Step end +1 MiB a minute, step peak +1.5 MiB a minute from 2 GiB above: hand arithmetic."""
    base, n = 10 * GiB, 20
    reports = [report_at(s, current={"sharded_param": base + (s - 1) * MiB},
                         peak_total=base + 2 * GiB + (s - 1) * (3 * MiB // 2), t=60.0 * (s - 1))
               for s in range(1, n + 1)]
    reports[5] = report_at(6, peak_total=70 * GiB, t=300.0, aborted=True)  # an OOM: left out of the fits
    path = write(tmp_path / "r.jsonl", reports)
    text = run_report([path], tmp_path / "r.html")
    row = forecast_rows(text)[0]
    end_now, peak_now = base + (n - 1) * MiB, base + 2 * GiB + (n - 1) * (3 * MiB // 2)
    hours_end = (80 * GiB - end_now) / (60 * MiB)  # 60 MiB an hour
    hours_peak = (80 * GiB - peak_now) / (90 * MiB)
    assert float(row["end-per-hour"]) == pytest.approx(60 * MiB, rel=1e-9)
    assert float(row["peak-per-hour"]) == pytest.approx(90 * MiB, rel=1e-9)
    assert float(row["end-now"]) == pytest.approx(end_now, rel=1e-12)
    assert float(row["hours"]) == pytest.approx(min(hours_end, hours_peak), rel=1e-9)
    assert row["series"] == "step_peak" and int(row["capacity"]) == 80 * GiB and row["device"] == "cuda:0"
    assert "fig-forecast" in text and hours_text(min(hours_end, hours_peak)) in section(text, "forecast")
    # what-if on a 40 GB card: --capacity overrides the device's
    text = run_report([path], tmp_path / "r40.html", "--capacity", "40GB")
    row = forecast_rows(text)[0]
    assert int(row["capacity"]) == 40 * 10**9
    assert float(row["hours"]) == pytest.approx(min((40e9 - end_now) / (60 * MiB), (40e9 - peak_now) / (90 * MiB)),
                                                rel=1e-9)
    # past the capacity: 0 hours
    row = forecast_rows(run_report([path], tmp_path / "r1.html", "--capacity", "1GiB"))[0]
    assert float(row["hours"]) == 0.0


def test_forecast_fits_the_last_hour(tmp_path: Path) -> None:
    """Over 3 hours: flat for 2, then +10 MiB a minute: only the last hour counts (and the reverse: grown
    for 2 hours, flat in the last one, gives no forecast)."""
    mins = np.arange(0, 181, 5)
    late = [report_at(i + 1, current={"activation": GiB + max(0, int(m) - 120) * 10 * MiB}, t=60.0 * m, capacity=None)
            for i, m in enumerate(mins)]
    text = run_report([write(tmp_path / "late.jsonl", late)], tmp_path / "late.html", "--capacity", "80GiB")
    row = forecast_rows(text)[0]
    assert float(row["end-per-hour"]) == pytest.approx(600 * MiB, rel=1e-9)
    assert float(row["hours"]) == pytest.approx((80 * GiB - (GiB + 600 * MiB)) / (600 * MiB), rel=1e-9)
    assert int(row["capacity"]) == 80 * GiB
    early = [report_at(i + 1, current={"activation": GiB + min(int(m), 120) * 10 * MiB}, t=60.0 * m)
             for i, m in enumerate(mins)]
    text = run_report([write(tmp_path / "early.jsonl", early)], tmp_path / "early.html")
    assert "Flat: no forecast" in section(text, "forecast") and "data-hours" not in text


@pytest.mark.parametrize("shape", ["plateau", "step-1 jump", "constant"])
def test_no_forecast_without_steady_growth(tmp_path: Path, shape: str) -> None:
    def total(s: int) -> int:
        if shape == "plateau":  # a warm-up that levels off at step 12 of 40
            return 10 * GiB + min(s, 12) * 64 * MiB
        if shape == "step-1 jump":  # the optimizer state, created by step 1's optimizer step
            return 10 * GiB + (0 if s == 1 else 20 * GiB)
        return 10 * GiB

    reports = [report_at(s, current={"activation": total(s)}, peak_total=total(s) + GiB) for s in range(1, 41)]
    text = run_report([write(tmp_path / "r.jsonl", reports)], tmp_path / "r.html")
    assert "Flat: no forecast" in section(text, "forecast") and "data-hours" not in text
    assert "No leak found over 40 steps" in section(text, "leaks")


def test_cpu_run_needs_a_capacity(tmp_path: Path) -> None:
    reports = [report_at(s, current={"inputs": s * MiB}, device="cpu", capacity=None) for s in range(1, 21)]
    path = write(tmp_path / "r.jsonl", reports)
    text = run_report([path], tmp_path / "r.html")
    assert "no capacity known (give --capacity)" in section(text, "forecast") and "data-hours" not in text
    text = run_report([path], tmp_path / "c.html", "--capacity", "1TiB")
    row = forecast_rows(text)[0]
    # +1 MiB a second (a step a second), the step peak equal to the step end
    assert float(row["hours"]) == pytest.approx(((1 << 40) - 20 * MiB) / (3600 * MiB), rel=1e-9)
    assert row["capacity"] == str(1 << 40) and "(--capacity)" in section(text, "forecast")


@pytest.mark.parametrize("bad", ["80XB", "abc", "0", "-5GiB", "80iB", "1.5.2G", ""])
def test_capacity_bad_input_names_the_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    path = write(tmp_path / "r.jsonl", [report_at(1)])
    with pytest.raises(SystemExit) as e:
        report_main([str(path), "-o", str(tmp_path / "r.html"), f"--capacity={bad}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --capacity" in err and "80GiB" in err


def test_parse_size() -> None:
    assert parse_size("80GiB") == parse_size("80G") == parse_size("80 gib") == 80 * GiB
    assert parse_size("80GB") == 80 * 10**9 and parse_size("512MB") == 512 * 10**6
    assert parse_size("1.5TiB") == 3 * (1 << 39) and parse_size("512") == parse_size("512B") == 512
    assert parse_size("64KiB") == parse_size("64k") == 65536


def test_in_memory_report_has_the_sections() -> None:
    reports = [report_at(s, rank=rk, current={"activation": 4096 * s}) for s in range(1, 16) for rk in (0, 1)]
    rep = build_report(RunIndex.of(reports))
    assert [s.id for s in rep.sections] == ["leaks", "forecast"]
    assert dict(rep.summary)["leaks"].startswith("activation growing on 2 of 2 ranks")
    text = render_html(rep)
    assert text.count("Plotly.newPlot(") == len(rep.figures) + sum(len(s.figures) for s in rep.sections)
    assert {r["category"] for r in table_rows(text, "leak-table")} == {"activation", TOTAL}


def test_trend_builder_keeps_the_later_of_a_repeated_step() -> None:
    a = report_at(3, current={"activation": 1})
    b = report_at(3, current={"activation": 2})
    got = TrendBuilder.of([report_at(1), a, report_at(2), b])[0]
    assert got.steps.tolist() == [1, 2, 3]
    assert got.end_bytes("activation").tolist() == [0, 0, 2]
    assert find_leaks(got).growing == []
    assert CATEGORY_KEYS[-1] == TOTAL
