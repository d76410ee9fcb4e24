"""``fsdp-mem-otel report``: the plotted numbers against the JSON lines, downsampling, the page drawn
by headless Chromium, a real 2-rank FSDP2 run with deep steps and an aborted step, CLI errors.

The oracle for every plotted number is the JSONL text itself, parsed with ``json`` (not the
report's own reader); the page's figures are parsed back out of the HTML.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fsdp_mem_otel.exporters.jsonl import JSONLExporter, read_reports, rotated_files
from fsdp_mem_otel.offline import jsonl_format
from fsdp_mem_otel.offline.report import (
    RunIndex,
    build_report,
    downsample,
    module_snapshots,
    render_html,
    report_main,
    scan_files,
    step_figure,
)
from fsdp_mem_otel.schema import CATEGORIES, STATES, TOTAL, ModuleReport, StepAbort, StepReport

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
FWD_STATES = [s for s in STATES[:4]] + ["peak_forward"]
BWD_STATES = [s for s in STATES[4:8]] + ["peak_backward"]


# -- synthetic runs ------------------------------------------------------------------------------
def synthetic(step: int, rank: int, n_modules: int = 4, deep_every: int = 3, aborted: bool = False) -> StepReport:
    dev = f"cuda:{rank}"

    def bd(seed: int) -> dict[str, dict[str, int]]:
        cats = {c: (seed * 7919 + i * 104729 + rank * 31) % 5_000_000 * 1024 for i, c in enumerate(CATEGORIES)}
        cats[TOTAL] = sum(cats.values())
        return {dev: cats}

    keys = ["<root>"] + [f"layers.{i}" for i in range(n_modules - 1)] + ['odd </script> "name"']
    t0 = 1_700_000_000_000_000_000 + step * 10**9
    mods = {}
    for i, k in enumerate(keys):
        snaps, times = {}, {}
        for j, s in enumerate(FWD_STATES):
            snaps[s], times[s] = [bd(step * 1000 + i * 20 + j)], [t0 + i * 100 + j]
        for j, s in enumerate(BWD_STATES):
            snaps[s], times[s] = [bd(step * 1000 + i * 20 + 10 + j)], [t0 + 10**6 + (len(keys) - i) * 100 + j]
        mods[k] = ModuleReport(snaps, times)
    peak = bd(step)
    tot = peak[dev][TOTAL]
    return StepReport(
        step=step, rank=rank, world_size=2, mode="deep" if step % deep_every == 0 else "light", fsdp_version=2,
        peak=peak, modules=mods, module_order=keys, current=bd(step + 1),
        allocator={dev: {"allocated_bytes": float(tot - 4096), "reserved_bytes": float(tot + (1 << 20)),
                         "allocated_peak_bytes": float(tot + 512), "reserved_peak_bytes": float(tot + (2 << 20))},
                   "cpu": {"resident_bytes": 1e9}},
        local_rank=rank, timestamp=1.7e9 + step,
        aborted=StepAbort("OutOfMemoryError", "CUDA out of memory (injected)", True, "layers.1", "after_pre_backward",
                          bd(step + 7)) if aborted else None,
    )


def write_jsonl(path: Path, reports: list[StepReport]) -> None:
    path.write_text("".join(r.to_json() + "\n" for r in reports))


def raw_lines(*paths: Path) -> list[dict[str, Any]]:
    """The independent oracle: every JSON line, parsed with json (rotated files decompressed with gzip)."""
    texts = [gzip.decompress(Path(p).read_bytes()).decode() if str(p).endswith(".gz") else Path(p).read_text()
             for p in paths]
    return [json.loads(line) for text in texts for line in text.splitlines() if line.strip()]


# -- reading the page back -----------------------------------------------------------------------
def _decode(v: Any) -> Any:
    if isinstance(v, dict) and "bdata" in v:
        arr = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]).newbyteorder("<"))
        return arr.reshape(v["shape"]).tolist() if "shape" in v else arr.tolist()
    if isinstance(v, dict):
        return {k: _decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def page_figures(text: str) -> dict[str, dict[str, Any]]:
    """div id -> {"data": [...], "layout": {...}} for every Plotly.newPlot call in the page."""
    dec = json.JSONDecoder()
    figs = {}
    for m in re.finditer(r"Plotly\.newPlot\(\s*", text):
        pos = m.end()
        div, pos = dec.raw_decode(text, pos)
        pos = re.compile(r"\s*,\s*").match(text, pos).end()  # type: ignore[union-attr]
        data, pos = dec.raw_decode(text, pos)
        pos = re.compile(r"\s*,\s*").match(text, pos).end()  # type: ignore[union-attr]
        layout, pos = dec.raw_decode(text, pos)
        figs[div] = {"data": _decode(data), "layout": layout}
    return figs


def assert_self_contained(text: str) -> None:
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I), "external script"
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?https?://", text, re.I), "external stylesheet"
    assert not re.search(r"<(img|iframe)[^>]*\bsrc\s*=\s*[\"']?https?://", text, re.I), "external resource"
    assert "@import" not in text.split("<script", 1)[0]


def close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=0, abs=0)  # exact: plotted in bytes / 2**k, a power of two


def check_page_against_jsonl(text: str, lines: list[dict[str, Any]],
                             drawn: set[int] | None = None) -> dict[str, dict[str, Any]]:
    """Every plotted number of the page equals the JSON lines' numbers; the per-step chart draws
    the ranks ``drawn`` (default: every rank)."""
    figs = page_figures(text)
    by = {(d["rank"], d["step"]): d for d in lines}  # later lines win, as in the report
    ranks = sorted({d["rank"] for d in lines})
    devices = {}
    for rk in ranks:
        totals: dict[str, int] = {}
        for d in lines:
            if d["rank"] == rk:
                for dev, cats in d["peak"].items():
                    totals[dev] = max(totals.get(dev, 0), cats[TOTAL])
        accel = {k: v for k, v in totals.items() if k != "cpu"}
        devices[rk] = max(accel, key=accel.__getitem__) if accel else "cpu"

    # per-step chart
    steps = figs["fig-steps"]
    scale = steps["layout"]["meta"]["scale"]
    seen_ranks = set()
    for tr in steps["data"]:
        rk, kind = tr["meta"]["rank"], tr["meta"]["kind"]
        seen_ranks.add(rk)
        dev = devices[rk]
        assert tr["meta"]["device"] == dev
        for x, y in zip(tr["x"], tr["y"], strict=True):
            d = by[(rk, x)]
            if kind == "category":
                assert y * scale == d["peak"][dev][tr["meta"]["category"]]
            elif kind == "allocator":
                stats = d["allocator"][dev]
                want = next(stats[k] for k in tr["meta"]["keys"].split("|") if k in stats)
                assert y * scale == want
            else:
                assert y * scale == d["peak"][dev][TOTAL]
        if kind == "deep":
            assert all(by[(rk, x)]["mode"] == "deep" for x in tr["x"])
        if kind == "aborted":
            for x, t in zip(tr["x"], tr["text"], strict=True):
                a = by[(rk, x)]["aborted"]
                assert a is not None and a["module"] in t and a["state"] in t and a["error"] in t
    assert seen_ranks == (set(ranks) if drawn is None else drawn)

    # module views: bars in execution order = the snapshots sorted by time, values equal
    for fid in ("fig-modules-selected", "fig-modules-worst"):
        if fid not in figs:
            continue
        fig = figs[fid]
        meta = fig["layout"]["meta"]
        d = by[(meta["rank"], meta["step"])]
        dev, mscale = meta["device"], meta["scale"]
        snaps = sorted(
            (t, mod, s, c, b[dev])
            for mod, m in d["modules"].items()
            for s, calls in m["snapshots"].items()
            for c, (b, t) in enumerate(zip(calls, m["times"][s], strict=True))
        )
        bars = [tr for tr in fig["data"] if tr["type"] == "bar"]
        assert bars
        for tr in bars:
            cat = tr["meta"]["category"]
            expect = [b[cat] for *_, b in snaps]
            if d["aborted"]:
                expect.append(d["aborted"]["breakdown"][dev][cat])
                assert tr["x"][-1].startswith("ABORT")
                assert d["aborted"]["module"] in tr["x"][-1] and d["aborted"]["state"] in tr["x"][-1]
            assert [y * mscale for y in tr["y"]] == expect
            assert [x.split(" · ")[0] for x in tr["x"][: len(snaps)]] == [mod for _, mod, *_ in snaps]

    # heatmap: rank x module peak
    if "fig-heatmap" in figs:
        hm = figs["fig-heatmap"]
        hscale = hm["layout"]["meta"]["scale"]
        for tr in hm["data"]:
            step = tr["meta"]["step"]
            for ylab, row in zip(tr["y"], tr["z"], strict=True):
                rk = int(ylab.split()[-1])
                line = by.get((rk, step))
                for mod, z in zip(tr["x"], row, strict=True):
                    if line is None or mod not in line["modules"]:
                        assert z is None
                        continue
                    want = max(b[devices[rk]][TOTAL] for calls in line["modules"][mod]["snapshots"].values()
                               for b in calls)
                    assert z * hscale == want

    # rank skew
    if "fig-skew" in figs:
        sk = figs["fig-skew"]["data"][0]
        sscale = figs["fig-skew"]["layout"]["meta"]["scale"]
        for x, y in zip(sk["x"], sk["y"], strict=True):
            vals = [by[(rk, x)]["peak"][devices[rk]][TOTAL] for rk in ranks if (rk, x) in by]
            assert y * sscale == max(vals) - min(vals)
    return figs


def screenshot(html_path: Path, png: Path) -> None:
    assert CHROMIUM is not None
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={png}",
         "--window-size=1400,3000", "--virtual-time-budget=10000", html_path.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert png.exists(), proc.stderr[-2000:]


def assert_drawn(png: Path) -> None:
    """Not blank: many colours, and the chart areas (not just the text at the top) are painted."""
    from PIL import Image

    img = np.asarray(Image.open(png).convert("RGB"), dtype=np.int32)
    h, w, _ = img.shape
    colours = len(np.unique(img.reshape(-1, 3), axis=0))
    non_white = float((img.sum(axis=2) < 720).mean())
    assert colours > 200, f"only {colours} colours: charts not drawn"
    assert non_white > 0.03, f"only {non_white:.1%} non-white pixels"
    # the per-step chart's plot area (below the header) holds coloured (not grey) pixels
    band = img[250:1200]
    coloured = int(((band.max(axis=2) - band.min(axis=2)) > 60).sum())
    assert coloured > 5000, f"no coloured chart pixels ({coloured})"


# -- tests ---------------------------------------------------------------------------------------
def test_downsample_keeps_deep_aborted_and_maximum() -> None:
    rng = np.random.default_rng(0)
    n, max_points = 10_000, 200
    peaks = rng.integers(0, 10**9, n).tolist()
    keep = [(i % 97 == 0) for i in range(n)]
    idx = downsample(peaks, keep, max_points)
    assert idx == sorted(set(idx))
    assert set(i for i in range(n) if keep[i]) <= set(idx)
    assert int(np.argmax(peaks)) in idx
    assert len(idx) <= max_points + sum(keep)
    for b in range(max_points):  # every bucket's maximum is drawn
        lo, hi = n * b // max_points, n * (b + 1) // max_points
        assert lo + int(np.argmax(peaks[lo:hi])) in idx
    assert downsample(peaks[:50], keep[:50], 200) == list(range(50))
    with pytest.raises(ValueError, match="max_points"):
        downsample(peaks, keep, 0)


def test_step_chart_downsampled_keeps_deep_aborted_and_max() -> None:
    n = 3000
    reports = [synthetic(s, 0, n_modules=1, deep_every=50, aborted=s in (7, 1234, 2999)) for s in range(1, n + 1)]
    dev = "cuda:0"
    fig = step_figure(RunIndex.of(reports), max_points=100)
    traces = {(t.meta["kind"], t.meta.get("category")): t for t in fig.data}
    xs = {int(v) for v in traces[("category", CATEGORIES[0])].x}
    assert {s for s in range(1, n + 1) if s % 50 == 0} <= xs
    assert {7, 1234, 2999} <= xs
    assert max(reports, key=lambda r: r.peak[dev][TOTAL]).step in xs
    assert len(xs) <= 100 + n // 50 + 3
    assert {int(v) for v in traces[("deep", None)].x} == {s for s in range(1, n + 1) if s % 50 == 0}
    assert {int(v) for v in traces[("aborted", None)].x} == {7, 1234, 2999}


def test_module_order_follows_snapshot_times() -> None:
    r = synthetic(1, 0)
    snaps = module_snapshots(r, "cuda:0")
    n = len(r.module_order)
    fwd = [(s.module, s.state) for s in snaps[: 5 * n]]
    assert fwd[:5] == [("<root>", s) for s in FWD_STATES]
    assert all(s.forward for s in snaps[: 5 * n]) and not any(s.forward for s in snaps[5 * n :])
    assert snaps[5 * n].module == r.module_order[-1]  # backward runs in reverse


def test_synthetic_two_files_page_matches_jsonl(tmp_path: Path) -> None:
    files = []
    for rk in (0, 1):
        reports = [synthetic(s, rk, aborted=(s == 5)) for s in range(1, 13)]
        files.append(tmp_path / f"run.rank{rk}.jsonl")
        write_jsonl(files[-1], reports)
    out = tmp_path / "new" / "dir" / "report.html"
    assert report_main([*map(str, files), "-o", str(out), "--step", "4", "--rank", "0", "-q"]) == 0
    text = out.read_text()
    assert_self_contained(text)
    lines = raw_lines(*files)
    assert [StepReport.from_dict(d) for d in lines] == list(read_reports(*files))
    figs = check_page_against_jsonl(text, lines)
    assert {"fig-steps", "fig-modules-selected", "fig-modules-worst", "fig-heatmap", "fig-skew"} <= set(figs)
    assert figs["fig-modules-selected"]["layout"]["meta"]["step"] == 4
    assert "&lt;/script&gt;" in text or "\\u003c\\u002fscript" in text  # odd module name escaped
    assert "</script> \"name\"" not in text


def test_one_file_holding_two_ranks(tmp_path: Path) -> None:
    path = tmp_path / "all.jsonl"
    write_jsonl(path, [synthetic(s, rk) for s in range(1, 6) for rk in (0, 1)])
    out = tmp_path / "r.html"
    assert report_main([str(path), "-o", str(out), "-q"]) == 0
    figs = check_page_against_jsonl(out.read_text(), raw_lines(path))
    assert "fig-heatmap" in figs and "fig-skew" in figs
    assert {tr["meta"]["rank"] for tr in figs["fig-steps"]["data"]} == {0, 1}


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.jsonl"
    write_jsonl(good, [synthetic(s, 0) for s in (1, 2)])
    with pytest.raises(SystemExit) as e:
        report_main([str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "r.html")])
    assert e.value.code == 2 and "argument RUN.jsonl" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    from fsdp_mem_otel.cli import main as cli_main

    assert cli_main(["report", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "r.html"), "-q"]) == 2
    assert "empty.jsonl (RUN.jsonl): is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report_main([str(good), "-o", str(tmp_path)])
    assert "argument -o/--output" in capsys.readouterr().err
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(SystemExit):
        report_main([str(good), "-o", str(blocker / "sub" / "r.html")])
    assert "argument -o/--output" in capsys.readouterr().err and "is a file" in capsys.readouterr().err + "is a file"
    assert report_main([str(good), "-o", str(tmp_path / "r.html"), "--step", "99", "-q"]) == 2
    assert "--step 99" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report_main([str(good), "-o", str(tmp_path / "r.html"), "--max-points", "0"])
    assert "--max-points" in capsys.readouterr().err
    # a truncated last line is skipped with a warning, the rest is drawn; progress on stderr
    with open(good, "a") as f:
        f.write(synthetic(3, 0).to_json()[:300])
    assert report_main([str(good), "-o", str(tmp_path / "r2.html")]) == 0
    err = capsys.readouterr().err
    assert "skipping truncated last line" in err and "read " in err and "wrote " in err


def test_report_does_not_import_torch(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_jsonl(path, [synthetic(1, 0)])
    code = (
        "import sys\nfrom fsdp_mem_otel.offline.report import report_main\n"
        f"assert report_main([{str(path)!r}, '-o', {str(tmp_path / 'r.html')!r}, '-q']) == 0\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


# -- a real 2-rank FSDP2 run ---------------------------------------------------------------------
def train_for_report(path_template: str) -> int:
    """Rank side: 6 FSDP2 steps, deep_every=2, step 3 aborted by a RuntimeError in layers.1's forward."""
    import torch.distributed as dist

    from fsdp_mem_otel.exporters.jsonl import JSONLExporter
    from fsdp_mem_otel.tools.demo import Block, WrapOptions, build, make_batch, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    rank = dist.get_rank()
    model, opt = build(3, 64, WrapOptions(fsdp=2))
    block = [m for m in model.modules() if isinstance(m, Block)][1]
    armed = {"on": False}

    def boom(*_: Any) -> None:
        if armed["on"]:
            armed["on"] = False
            raise RuntimeError("injected failure in layers.1 forward")

    block.register_forward_pre_hook(boom)
    tracker = FSDPMemoryTracker(model, opt, deep_every=2, exporters=[JSONLExporter(path_template.format(rank=rank))])
    tracker.attach()
    for step in range(6):
        armed["on"] = step == 2
        try:
            with tracker.step_scope():
                train_step(model, opt, make_batch(step, 16, 64, rank), on_inputs=tracker.track_inputs)
        except RuntimeError:
            model.reset_iter_state()  # type: ignore[operator]
            opt.zero_grad(set_to_none=True)
        tracker.step()
    tracker.close()
    return tracker.errors_total


def test_real_fsdp2_run_report(tmp_path: Path) -> None:
    from tests.dist import run_ranks

    template = str(tmp_path / "run.rank{rank}.jsonl")
    assert run_ranks(train_for_report, template) == [0, 0]
    files = [Path(template.format(rank=r)) for r in (0, 1)]
    lines = raw_lines(*files)
    assert len(lines) == 12
    assert [d["mode"] for d in lines if d["rank"] == 0] == ["light", "deep"] * 3
    aborted = [d for d in lines if d["aborted"]]
    assert {d["step"] for d in aborted} == {3} and {d["aborted"]["module"] for d in aborted} == {"layers.1"}

    out = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "fsdp_mem_otel.offline.report", *map(str, files), "-o", str(out),
                           "--step", "3"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stderr
    text = out.read_text()
    assert_self_contained(text)
    figs = check_page_against_jsonl(text, lines)
    sel = figs["fig-modules-selected"]
    assert sel["layout"]["meta"]["step"] == 3
    assert any("ABORT" in x and "layers.1" in x for tr in sel["data"] if tr["type"] == "bar" for x in tr["x"])
    ab = [tr for tr in figs["fig-steps"]["data"] if tr["meta"]["kind"] == "aborted"]
    assert ab and all(tr["x"] == [3] and "layers.1" in tr["text"][0] for tr in ab)
    deep = [tr for tr in figs["fig-steps"]["data"] if tr["meta"]["kind"] == "deep"]
    assert deep and all(tr["x"] == [2, 4, 6] for tr in deep)
    assert "rank 0: step 3 aborted (RuntimeError) in layers.1" in text

    # the side index gives the same page as a full scan of the same run without it
    assert all(Path(str(f) + ".index").is_file() for f in files)
    plain = tmp_path / "no_index"
    plain.mkdir()
    for f in files:
        shutil.copy(f, plain / f.name)
    out2 = plain / "report.html"
    assert report_main([*(str(plain / f.name) for f in files), "-o", str(out2), "--step", "3", "-q"]) == 0
    assert out2.read_text() == text
    assert_same_scan(scan_files([str(plain / f.name) for f in files]), scan_files(list(map(str, files))))

    assert CHROMIUM is not None, "no chromium on PATH: scripts/setup.sh installs Debian's chromium package"
    png = tmp_path / "report.png"
    screenshot(out, png)
    assert_drawn(png)
    if os.environ.get("FSDP_MEM_OTEL_KEEP_SCREENSHOT"):
        shutil.copy(png, os.environ["FSDP_MEM_OTEL_KEEP_SCREENSHOT"])
        shutil.copy(out, os.environ["FSDP_MEM_OTEL_KEEP_SCREENSHOT"] + ".html")


# -- side index ----------------------------------------------------------------------------------
def assert_same_scan(a: RunIndex, b: RunIndex) -> None:
    """Same step-level reports and the same line locations: the two RunIndexes draw the same page."""
    assert a.ranks == b.ranks
    assert a.duplicates == b.duplicates
    for rk in a.ranks:
        sa, sb = a.series[rk], b.series[rk]
        assert sa == sb
        where_a = [sa.location(int(st)) for st in sa.steps]
        where_b = [sb.location(int(st)) for st in sb.steps]
        assert None not in where_a and None not in where_b
        assert [(os.path.basename(p), s, e) for p, s, e in where_a] == [(os.path.basename(p), s, e)  # type: ignore[misc]
                                                                      for p, s, e in where_b]  # type: ignore[misc]


def exported_run(tmp_path: Path, steps: int = 14, max_bytes: int = 0) -> list[Path]:
    """A 2-rank run written by JSONLExporter (with its side index), one file per rank."""
    files = []
    for rk in (0, 1):
        path = tmp_path / f"run.rank{rk}.jsonl"
        exp = JSONLExporter(path, max_bytes=max_bytes, backup_count=9, modules_every=1)
        for s in range(1, steps + 1):
            exp.export(synthetic(s, rk, aborted=(s == 5)))
        exp.shutdown()
        assert exp.errors_total == 0
        files.append(path)
    return files


def without_index(files: list[Path], dest: Path) -> list[Path]:
    dest.mkdir()
    for f in files:
        for part in rotated_files(f):
            shutil.copy(part, dest / os.path.basename(part))
    return [dest / f.name for f in files]


def page(files: list[Path], out: Path) -> str:
    assert report_main([*map(str, files), "-o", str(out), "--step", "4", "--rank", "1", "--max-points", "5",
                        "-q"]) == 0
    return out.read_text()


def test_index_page_equals_full_scan_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = exported_run(tmp_path / "idx", max_bytes=3 * (len(synthetic(1, 0).to_json()) + 1))  # rotated
    assert all(Path(p + ".index").is_file() for f in files for p in rotated_files(f))
    assert len(rotated_files(files[0])) == 5
    plain = without_index(files, tmp_path / "plain")
    expected = page(plain, tmp_path / "plain" / "r.html")
    # with the index the data files are only read at the chosen steps' lines (and spot checks)
    scanned: list[str] = []
    real_range = jsonl_format._scan_range
    monkeypatch.setattr(jsonl_format, "_scan_range",
                        lambda f, path, *a: scanned.append(path) or real_range(f, path, *a))
    assert page(files, tmp_path / "idx" / "r.html") == expected
    assert scanned == []
    check_page_against_jsonl(expected, raw_lines(*(p for f in plain for p in rotated_files(f))))
    assert_same_scan(scan_files(list(map(str, files))), scan_files(list(map(str, plain))))


def _drop_last(text: str) -> str:
    return "".join(text.splitlines(keepends=True)[:-3])


def _torn(text: str) -> str:
    return text[: len(text) - 40]


def _garbage_middle(text: str) -> str:
    lines = text.splitlines(keepends=True)
    lines[4] = "{not json\n"
    return "".join(lines)


def _past_end(text: str) -> str:
    lines = text.splitlines(keepends=True)
    e = json.loads(lines[-1])
    e["offset"] += 10**6
    return "".join(lines[:-1]) + json.dumps(e) + "\n"


def _out_of_order(text: str) -> str:
    lines = text.splitlines(keepends=True)
    lines[2], lines[3] = lines[3], lines[2]
    return "".join(lines)


def _shifted(text: str) -> str:  # every entry one byte off
    out = []
    for line in text.splitlines():
        e = json.loads(line)
        e["offset"] += 1
        out.append(json.dumps(e) + "\n")
    return "".join(out)


def _other_step(text: str) -> str:  # an entry whose fields do not match its line (a stale index)
    lines = text.splitlines(keepends=True)
    e = json.loads(lines[-1])
    e["report"]["step"] += 100
    return "".join(lines[:-1]) + json.dumps(e) + "\n"


@pytest.mark.parametrize(("name", "corrupt", "warns"), [
    ("missing", None, False),
    ("truncated", _drop_last, False),
    ("torn last entry", _torn, False),
    ("empty", lambda t: "", False),
    ("garbage entry", _garbage_middle, True),
    ("past the end", _past_end, True),
    ("out of order", _out_of_order, True),
    ("shifted", _shifted, True),
    ("stale fields", _other_step, True),
])
def test_bad_index_falls_back_with_same_page(tmp_path: Path, name: str, corrupt: Any, warns: bool) -> None:
    files = exported_run(tmp_path / "idx")
    plain = without_index(files, tmp_path / "plain")
    expected_scan = scan_files(list(map(str, plain)))
    expected = page(plain, tmp_path / "plain" / "r.html")
    ipath = Path(str(files[0]) + ".index")
    if corrupt is None:
        ipath.unlink()
    else:
        ipath.write_text(corrupt(ipath.read_text()))
    notes: list[str] = []
    import warnings as w

    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        got = scan_files(list(map(str, files)), progress=notes.append)
    assert_same_scan(got, expected_scan)
    msgs = [str(c.message) for c in caught]
    if warns:
        assert len(msgs) == 1 and "index does not fit its data file" in msgs[0], msgs
    else:
        assert msgs == []
    if corrupt is None:
        assert any("no index" in n for n in notes)
    assert page(files, tmp_path / "idx" / "r.html") == expected
    proc = subprocess.run([sys.executable, "-m", "fsdp_mem_otel.offline.report", *map(str, files), "-o",
                           str(tmp_path / "cli.html")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if warns:
        assert "index does not fit its data file" in proc.stderr  # the stderr note
    elif corrupt is None:
        assert "no index" in proc.stderr


def test_lines_without_index_entries_are_scanned(tmp_path: Path) -> None:
    """Lines the index misses (an index write failed, a crash between data and index write, a torn
    data line) are read from the data file; the rest still comes from the index."""
    files = exported_run(tmp_path / "idx")
    ipath = Path(str(files[1]) + ".index")
    lines = ipath.read_text().splitlines(keepends=True)
    ipath.write_text("".join(lines[:3] + lines[5:-1]))  # entries 4, 5 and the last one lost
    with open(files[1], "a") as f:
        f.write(synthetic(99, 1).to_json()[:300])  # a crash mid-line
    plain = without_index(files, tmp_path / "plain")
    with pytest.warns(RuntimeWarning, match=r"run\.rank1\.jsonl:15: skipping truncated last line"):
        expected = scan_files(list(map(str, plain)))
    notes: list[str] = []
    with pytest.warns(RuntimeWarning, match=r"run\.rank1\.jsonl:15: skipping truncated last line"):
        got = scan_files(list(map(str, files)), progress=notes.append)
    assert_same_scan(got, expected)
    assert any("not in its index" in n for n in notes)


def test_index_files_given_as_paths_are_skipped(tmp_path: Path) -> None:
    files = exported_run(tmp_path)
    idx = [str(f) + ".index" for f in files]
    assert_same_scan(scan_files([*map(str, files), *idx]), scan_files(list(map(str, files))))
    with pytest.raises(ValueError, match="only side index files"):
        scan_files(idx)


def test_build_report_in_memory_renders() -> None:
    reports = [synthetic(s, rk) for s in range(1, 4) for rk in (0, 1)]
    rep = build_report(RunIndex.of(reports))
    text = render_html(rep)
    assert text.count("Plotly.newPlot(") == len(rep.figures) == 4  # last step is the highest: one module view
    assert_self_contained(text)


def test_many_ranks_page_draws_top_ranks_and_a_fleet_chart(tmp_path: Path) -> None:
    """Past --max-ranks, the per-step chart draws the highest-peak ranks (and the selected one);
    the fleet chart's highest / median / lowest per step and the heatmap cover every rank."""
    files = []
    for rk in range(12):
        reports = [synthetic(s, rk, aborted=(s == 5 and rk == 7)) for s in range(1, 9)]
        files.append(tmp_path / f"run.rank{rk}.jsonl")
        write_jsonl(files[-1], reports)
    out = tmp_path / "r.html"
    assert report_main([*map(str, files), "-o", str(out), "--max-ranks", "4", "--rank", "2", "-q"]) == 0
    lines = raw_lines(*files)
    dev = {rk: f"cuda:{rk}" for rk in range(12)}
    best = {rk: max(d["peak"][dev[rk]][TOTAL] for d in lines if d["rank"] == rk) for rk in range(12)}
    top = sorted((rk for rk in best if rk != 2), key=lambda rk: (-best[rk], rk))[:3]
    figs = check_page_against_jsonl(out.read_text(), lines, drawn={2, *top})
    heat = figs["fig-heatmap"]["data"][0]
    assert [int(y.split()[-1]) for y in heat["y"]] == list(range(12))
    fleet = figs["fig-fleet"]
    scale = fleet["layout"]["meta"]["scale"]
    traces = {tr["name"]: tr for tr in fleet["data"]}
    assert traces["highest rank"]["x"] == list(range(1, 9))
    for i, step in enumerate(range(1, 9)):
        vals = {rk: d["peak"][dev[rk]][TOTAL] for d in lines for rk in [d["rank"]] if d["step"] == step}
        assert traces["highest rank"]["y"][i] * scale == max(vals.values())
        assert traces["lowest rank"]["y"][i] * scale == min(vals.values())
        assert traces["median rank"]["y"][i] * scale == pytest.approx(float(np.median(list(vals.values()))))
        holder = max(vals, key=lambda rk: (vals[rk], -rk))
        assert traces["highest rank"]["text"][i].startswith(f"rank {holder} (12 ranks")


def test_scan_keeps_columns_not_reports(tmp_path: Path) -> None:
    """A scanned run keeps per-step columns (no StepReport but an aborted step's), and the complete
    reports read back for charts stay within the cache bound."""
    from fsdp_mem_otel.offline import run_index

    files = exported_run(tmp_path, steps=3 * run_index.FULL_CACHE)
    index = scan_files(list(map(str, files)))
    for rk in (0, 1):
        series = index.series[rk]
        assert series.complete == {} and sorted(series.aborts) == [5]
        assert series.steps.tolist() == list(range(1, 3 * run_index.FULL_CACHE + 1))
        assert series.nbytes < 400 * len(series)
        for st in series.steps.tolist():
            full = index.full(rk, int(st))
            assert full is not None and full.modules and full.step == st
    assert len(index._cache) == run_index.FULL_CACHE
