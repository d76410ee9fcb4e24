"""JSONL exporter: round trip (hand-built and from a real 2-rank FSDP2 run), rotation, truncated
lines, I/O faults counted and recovered from, validation, and no torch import."""

from __future__ import annotations

import copy
import errno
import gzip
import json
import logging
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from fsdp_mem_otel.exporters import jsonl
from fsdp_mem_otel.exporters.jsonl import JSONLExporter, read_reports, rotated_files
from fsdp_mem_otel.offline import jsonl_format
from fsdp_mem_otel.schema import CATEGORY_KEYS, STATES, ModuleReport, StepAbort, StepReport

REPO = Path(__file__).resolve().parents[2]


def make_report(step: int, rank: int = 0, n_modules: int = 3, aborted: bool = False) -> StepReport:
    b = {"cuda:0": {c: 1000 * step + i for i, c in enumerate(CATEGORY_KEYS)}}
    keys = ["<root>"] + [f"layers.{i}" for i in range(n_modules - 1)]
    mods = {
        k: ModuleReport({s: [b] for s in STATES}, {s: [1_700_000_000_000_000_000 + step] for s in STATES}) for k in keys
    }
    return StepReport(
        step=step, rank=rank, world_size=2, mode="light", fsdp_version=2, peak=b, modules=mods, module_order=keys,
        current=b, allocator={"cuda:0": {"allocated_bytes": 5000.0 + step, "fragmentation_ratio": 0.125},
                              "cpu": {"resident_bytes": 123456789.0}},
        local_rank=rank, duration_seconds=0.25 + step, tracker_overhead_seconds=0.0625, errors_total=0,
        timestamp=1_700_000_000.125 + step, start_time_ns=step * 10**9, end_time_ns=step * 10**9 + 5,
        aborted=StepAbort("OutOfMemoryError", "CUDA out of memory", True, "layers.1", "after_pre_forward", b)
        if aborted else None,
    )


def line_bytes(report: StepReport) -> int:
    """The bytes of ``report``'s line as the exporter writes it, newline included."""
    return len(jsonl_format.encode(report)[1])


def index_entries(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(str(path) + ".index").read_text().splitlines() if line.strip()]


def assert_index_matches(path: Path) -> None:
    """Every line of the data file has one index entry, in order, locating it exactly and holding
    its step-level fields (everything but modules and module_order)."""
    data = Path(path).read_bytes()
    entries = index_entries(path)
    pos = 0
    lines = data.split(b"\n")[:-1]
    assert len(entries) == len(lines)
    for e, line in zip(entries, lines, strict=True):
        assert (e["offset"], e["length"]) == (pos, len(line) + 1)
        assert data[e["offset"] : e["offset"] + e["length"]] == line + b"\n"
        full = json.loads(line)
        assert e["report"] == {k: v for k, v in full.items() if k not in ("modules", "module_order")}
        pos += len(line) + 1
    assert pos == len(data)


def export_all(exp: JSONLExporter, reports: list[StepReport]) -> None:
    for r in reports:
        exp.export(r)
    assert exp.flush(10)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    reports = [make_report(1), make_report(2, aborted=True), make_report(3)]
    exp = JSONLExporter(path, modules_every=1)
    export_all(exp, reports)
    lines = path.read_text().splitlines()
    assert lines == [jsonl_format.encode(r)[1].decode().rstrip("\n") for r in reports]  # one JSON object per line
    assert all(json.loads(line) == r.to_dict() for line, r in zip(lines, reports, strict=True))
    assert list(read_reports(path)) == reports
    assert list(read_reports(str(path))) == reports
    assert (exp.errors_total, exp.lines_total) == (0, 3)
    exp.shutdown()
    assert_index_matches(path)


def test_each_line_is_on_disk_after_export(tmp_path: Path) -> None:
    """No user-space buffering: once the writer is past a report, another reader sees it."""
    path = tmp_path / "run.jsonl"
    exp = JSONLExporter(path, modules_every=1)
    for step in (1, 2):
        exp.export(make_report(step))
        assert exp.flush(10)
        assert [r.step for r in read_reports(path)] == list(range(1, step + 1))
    exp.shutdown()


def test_appends_to_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    for step in (1, 2):
        exp = JSONLExporter(path, modules_every=1)
        export_all(exp, [make_report(step)])
        exp.shutdown()
    assert [r.step for r in read_reports(path)] == [1, 2]


def test_rank_placeholder_and_parent_dirs(tmp_path: Path) -> None:
    exp = JSONLExporter(tmp_path / "a" / "b" / "rank-{rank}.jsonl", modules_every=1)
    export_all(exp, [make_report(1, rank=3)])
    exp.shutdown()
    assert exp.path == str(tmp_path / "a" / "b" / "rank-3.jsonl")
    assert [r.rank for r in read_reports(exp.path)] == [3]


def test_rotation_by_size(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    line = line_bytes(make_report(1))
    exp = JSONLExporter(path, max_bytes=int(line * 2.5), backup_count=2, modules_every=1, compress=False)
    reports = [make_report(s) for s in range(1, 11)]
    export_all(exp, reports)
    exp.shutdown()
    assert sorted(os.listdir(tmp_path)) == ["run.jsonl", "run.jsonl.1", "run.jsonl.1.index", "run.jsonl.2",
                                            "run.jsonl.2.index", "run.jsonl.index"]
    for name in os.listdir(tmp_path):
        assert os.path.getsize(tmp_path / name) <= line * 2.5
    for name in ("run.jsonl", "run.jsonl.1", "run.jsonl.2"):  # each index describes its own data file
        assert_index_matches(tmp_path / name)
    assert rotated_files(path) == [str(path) + ".2", str(path) + ".1", str(path)]
    # 2 lines per file: steps 5-6 (.2), 7-8 (.1), 9-10 (base), oldest first
    assert [r.step for r in read_reports(path)] == [5, 6, 7, 8, 9, 10]
    assert list(read_reports(path)) == reports[4:]
    assert [r.step for r in read_reports(str(path) + ".1")] == [7, 8]  # a rotated file alone


def test_rotated_files_are_compressed_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    line = line_bytes(make_report(1))
    reports = [make_report(s) for s in range(1, 11)]
    plain = tmp_path / "plain" / "run.jsonl"
    for target, compress in ((path, True), (plain, False)):
        exp = JSONLExporter(target, max_bytes=int(line * 2.5), backup_count=3, modules_every=1, compress=compress)
        export_all(exp, reports)
        exp.shutdown()
        assert exp.errors_total == 0
    assert sorted(os.listdir(tmp_path)) == ["plain", "run.jsonl", "run.jsonl.1.gz", "run.jsonl.1.gz.index",
                                            "run.jsonl.2.gz", "run.jsonl.2.gz.index", "run.jsonl.3.gz",
                                            "run.jsonl.3.gz.index", "run.jsonl.index"]
    for i in (1, 2, 3):  # the same bytes as the plain rotation's, and the same index
        packed = Path(f"{path}.{i}.gz")
        assert gzip.decompress(packed.read_bytes()) == Path(f"{plain}.{i}").read_bytes()
        assert Path(f"{packed}.index").read_bytes() == Path(f"{plain}.{i}.index").read_bytes()
        assert packed.stat().st_size < Path(f"{plain}.{i}").stat().st_size / 3
    assert rotated_files(path) == [f"{path}.3.gz", f"{path}.2.gz", f"{path}.1.gz", str(path)]
    assert list(read_reports(path)) == reports[2:]  # steps 3-10: 2 lines per file
    # the report's reader: step-level fields from each compressed file's index, then whole lines
    notes: list[str] = []
    scanned = list(jsonl_format.scan([str(path)], progress=notes.append))
    assert [(f.path, [r.step for r in f.reports]) for f in scanned] == [
        (f"{path}.3.gz", [3, 4]), (f"{path}.2.gz", [5, 6]), (f"{path}.1.gz", [7, 8]), (str(path), [9, 10])]
    assert sum("via its index" in n for n in notes) == 4
    f = scanned[1]
    assert jsonl_format.read_line(f.path, *f.spans[1]) == reports[5]


def test_compression_failure_is_counted_and_the_file_stays_plain(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def disk_full(path: str, level: int = 6) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonl, "compress_pair", disk_full)
    path = tmp_path / "run.jsonl"
    line = line_bytes(make_report(1))
    exp = JSONLExporter(path, max_bytes=int(line * 1.5), backup_count=2, modules_every=1)
    with caplog.at_level(logging.WARNING, logger="fsdp_mem_otel"):
        export_all(exp, [make_report(s) for s in range(1, 4)])
        exp.shutdown()
    assert (exp.errors_total, exp.lines_total) == (2, 3)  # two rotations failed to compress, no line lost
    assert sum("compressing" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert rotated_files(path) == [f"{path}.2", f"{path}.1", str(path)]
    assert [r.step for r in read_reports(path)] == [1, 2, 3]


def test_a_crash_while_compressing_leaves_one_copy_read(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    exp = JSONLExporter(path, modules_every=1)
    export_all(exp, [make_report(1)])
    exp.shutdown()
    os.replace(path, f"{path}.1")
    # killed after the compressed copy was complete, before the plain file was removed
    Path(f"{path}.1.gz").write_bytes(gzip.compress(Path(f"{path}.1").read_bytes()))
    Path(f"{path}.1.gz.tmp").write_bytes(b"half a gzip")
    export_all(exp := JSONLExporter(path, modules_every=1), [make_report(2)])
    exp.shutdown()
    assert rotated_files(path) == [f"{path}.1", str(path)]
    assert [r.step for r in read_reports(path)] == [1, 2]


def test_rotation_without_backups_restarts_file(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    line = line_bytes(make_report(1))
    exp = JSONLExporter(path, max_bytes=int(line * 2.5), backup_count=0, modules_every=1)
    export_all(exp, [make_report(s) for s in range(1, 6)])
    exp.shutdown()
    assert sorted(os.listdir(tmp_path)) == ["run.jsonl", "run.jsonl.index"]
    assert [r.step for r in read_reports(path)] == [5]
    assert_index_matches(path)


def test_line_larger_than_cap_gets_own_file(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    exp = JSONLExporter(path, max_bytes=100, backup_count=5, modules_every=1, compress=False)
    export_all(exp, [make_report(s) for s in range(1, 4)])
    exp.shutdown()
    assert [len(Path(p).read_text().splitlines()) for p in rotated_files(path)] == [1, 1, 1]
    assert [r.step for r in read_reports(path)] == [1, 2, 3]


def test_truncated_last_line_skipped_with_warning(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    exp = JSONLExporter(path, modules_every=1)
    export_all(exp, [make_report(1), make_report(2)])
    exp.shutdown()
    with open(path, "a") as f:
        f.write(make_report(3).to_json()[:200])  # a crash mid-line
    with pytest.warns(RuntimeWarning, match=r"run\.jsonl:3: skipping truncated last line"):
        assert [r.step for r in read_reports(path)] == [1, 2]
    # the next writer terminates the cut line first, so its own lines stay readable
    exp = JSONLExporter(path, modules_every=1)
    export_all(exp, [make_report(4)])
    exp.shutdown()
    with pytest.warns(RuntimeWarning, match=r"run\.jsonl:3: skipping unreadable line"):
        assert [r.step for r in read_reports(path)] == [1, 2, 4]


def test_parent_is_a_file_counted_then_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Unwritable location (works as root, where chmod does not stop writes)."""
    blocker = tmp_path / "logs"
    blocker.write_text("not a directory")
    exp = JSONLExporter(blocker / "run.jsonl", modules_every=1)
    with caplog.at_level(logging.WARNING, logger="fsdp_mem_otel"):
        export_all(exp, [make_report(1), make_report(2), make_report(3)])  # never raises
        assert exp.errors_total == 3 and exp.lines_total == 0
        blocker.unlink()  # the fault clears
        export_all(exp, [make_report(4), make_report(5)])
    assert exp.errors_total == 3 and exp.lines_total == 2
    assert [r.step for r in read_reports(blocker / "run.jsonl")] == [4, 5]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1  # logged once per outage
    assert any("recovered" in r.getMessage() for r in caplog.records)
    exp.shutdown()


class FaultyFile:
    """A raw file whose writes fail with ENOSPC (after writing part of the line) while ``full``."""

    full = False

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: memoryview) -> int:
        if FaultyFile.full:
            self._f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(self._f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def test_disk_full_counted_then_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = open

    def faulty_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(path, mode, *args, **kwargs)
        return FaultyFile(f) if "a" in mode else f

    monkeypatch.setattr(jsonl, "open", faulty_open, raising=False)
    monkeypatch.setattr(FaultyFile, "full", False)
    path = tmp_path / "run.jsonl"
    exp = JSONLExporter(path, modules_every=1)
    with caplog.at_level(logging.WARNING, logger="fsdp_mem_otel"):
        export_all(exp, [make_report(1)])
        FaultyFile.full = True
        export_all(exp, [make_report(2), make_report(3)])
        assert exp.errors_total == 2
        FaultyFile.full = False
        export_all(exp, [make_report(4)])
    exp.shutdown()
    assert exp.errors_total == 2 and exp.lines_total == 2
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    with pytest.warns(RuntimeWarning, match="unreadable line"):  # the half-written line of step 2
        assert [r.step for r in read_reports(path)] == [1, 4]


def test_queue_full_drops_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    exp = JSONLExporter(tmp_path / "run.jsonl", max_queue=1, modules_every=1)
    real = exp._write_report

    def stalled(report: StepReport) -> None:  # a stuck file system
        gate.wait(10)
        real(report)

    monkeypatch.setattr(exp, "_write_report", stalled)
    for s in range(1, 6):
        exp.export(make_report(s))  # returns at once even though the writer is stuck
    assert exp.dropped_total >= 3 and exp.errors_total == exp.dropped_total
    gate.set()
    assert exp.flush(10)
    exp.shutdown()
    assert exp.lines_total == 5 - exp.dropped_total


def test_queue_bytes_count_light_steps_now_and_then(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """export() bounds the queue by report_bytes; on the training thread it counts a light step's
    snapshots on the first light step, every 100 and when the number of modules changes (else the
    last count), and every deep or aborted step."""
    reports = [make_report(s) for s in range(1, 206)]
    reports[49].mode = "deep"
    reports[59] = make_report(60, aborted=True)
    reports[149:] = [make_report(s, n_modules=2) for s in range(150, 206)]  # a module left at step 150
    expected = [jsonl.report_bytes(r) for r in reports]
    counted: list[int] = []
    real = jsonl.all_calls
    monkeypatch.setattr(jsonl, "all_calls", lambda modules: counted.append(len(modules)) or real(modules))
    exp = JSONLExporter(tmp_path / "run.jsonl")
    assert [exp._queue_bytes(r) for r in reports] == expected
    assert len(counted) == 5  # light steps 1, 103 (the 100th light step since), 150; deep 50, aborted 60
    exp.shutdown()


def test_shutdown_idempotent(tmp_path: Path) -> None:
    exp = JSONLExporter(tmp_path / "run.jsonl", modules_every=1)
    exp.shutdown()  # before any export: no thread, no file
    exp.shutdown()
    assert not (tmp_path / "run.jsonl").exists()
    exp = JSONLExporter(tmp_path / "run.jsonl", modules_every=1)
    exp.export(make_report(1))
    exp.shutdown()  # flushes
    exp.shutdown()
    exp.export(make_report(2))  # ignored after shutdown
    assert exp.flush(1)
    assert [r.step for r in read_reports(tmp_path / "run.jsonl")] == [1]
    assert exp._worker is not None and not exp._worker._thread.is_alive()


def test_validation(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="path"):
        JSONLExporter(123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="path"):
        JSONLExporter("")
    with pytest.raises(ValueError, match="max_bytes"):
        JSONLExporter(tmp_path / "x", max_bytes=-1)
    with pytest.raises(TypeError, match="max_bytes"):
        JSONLExporter(tmp_path / "x", max_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backup_count"):
        JSONLExporter(tmp_path / "x", backup_count=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_queue"):
        JSONLExporter(tmp_path / "x", max_queue=0)
    with pytest.raises(ValueError, match="paths"):
        read_reports()
    with pytest.raises(TypeError, match=r"paths\[1\]"):
        read_reports(tmp_path / "x", 5)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="no JSONL file"):
        read_reports(tmp_path / "missing.jsonl")


def test_no_torch_import(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from fsdp_mem_otel.exporters.jsonl import JSONLExporter, read_reports\n"
        "from fsdp_mem_otel.schema import StepReport\n"
        "e = JSONLExporter(sys.argv[1])\n"
        "e.export(StepReport(step=1, rank=0, world_size=1, mode='light', fsdp_version=2, peak={}, modules={}))\n"
        "e.shutdown()\n"
        "assert [r.step for r in read_reports(sys.argv[1])] == [1]\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "r.jsonl")], check=True, cwd=REPO, timeout=60)


# -- a real 2-rank FSDP2 run -----------------------------------------------------------------------
def train_with_jsonl(path_template: str) -> list[StepReport]:
    """Rank side: 3 FSDP2 steps under the tracker with a JSONLExporter; returns step() reports."""
    import torch.distributed as dist

    from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    rank = dist.get_rank()
    model, opt = build(3, 64, WrapOptions(fsdp=2))
    jsonl = JSONLExporter(path_template.format(rank=rank), modules_every=1)
    tracker = FSDPMemoryTracker(model, opt, exporters=[jsonl])
    reports = []
    with tracker:
        for step in range(3):
            train_step(model, opt, make_batch(step, 16, 64, rank))
            reports.append(tracker.step())
    tracker.close()
    assert tracker.errors_total == 0
    return reports


def test_real_fsdp2_run_round_trips(tmp_path: Path) -> None:
    from tests.dist import run_ranks

    template = str(tmp_path / "rank{rank}.jsonl")
    per_rank = run_ranks(train_with_jsonl, template)
    for rank, reports in enumerate(per_rank):
        read = list(read_reports(template.format(rank=rank)))
        assert len(read) == 3
        assert read == reports
        assert [r.to_dict() for r in read] == [r.to_dict() for r in reports]
        assert [r.rank for r in read] == [rank] * 3 and [r.step for r in read] == [1, 2, 3]
        assert all(r.modules for r in read)  # real per-module snapshots made the trip


# -- side index --------------------------------------------------------------------------------
def test_index_continues_when_appending(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    for steps in ((1, 2), (3,)):
        exp = JSONLExporter(path, modules_every=1)
        export_all(exp, [make_report(s) for s in steps])
        exp.shutdown()
    assert_index_matches(path)
    assert [e["report"]["step"] for e in index_entries(path)] == [1, 2, 3]


def test_index_paired_through_rotation_and_stale_index_dropped(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    line = line_bytes(make_report(1))
    Path(str(path) + ".2.index").write_text("stale\n")  # an index without its data file
    exp = JSONLExporter(path, max_bytes=int(line * 1.5), backup_count=3, modules_every=1, compress=False)
    export_all(exp, [make_report(s) for s in range(1, 4)])
    exp.shutdown()
    for p in rotated_files(path):
        assert_index_matches(Path(p))
    assert [index_entries(Path(p))[0]["report"]["step"] for p in rotated_files(path)] == [1, 2, 3]


def test_read_reports_ignores_index_files(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    reports = [make_report(s) for s in range(1, 4)]
    exp = JSONLExporter(path, modules_every=1)
    export_all(exp, reports)
    exp.shutdown()
    assert rotated_files(path) == [str(path)]
    assert list(read_reports(path, str(path) + ".index")) == reports
    with pytest.raises(ValueError, match="only side index files"):
        list(read_reports(str(path) + ".index"))


def test_index_write_failure_counted_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "run.jsonl"
    blocker = Path(str(path) + ".index")
    blocker.mkdir()  # the index cannot be opened
    exp = JSONLExporter(path, modules_every=1)
    with caplog.at_level(logging.WARNING, logger="fsdp_mem_otel"):
        export_all(exp, [make_report(1), make_report(2)])
        assert (exp.errors_total, exp.lines_total) == (2, 2)  # the data lines are written all the same
        blocker.rmdir()
        export_all(exp, [make_report(3)])
    exp.shutdown()
    assert (exp.errors_total, exp.lines_total) == (2, 3)
    assert [r.step for r in read_reports(path)] == [1, 2, 3]
    line = line_bytes(make_report(1))
    assert [(e["report"]["step"], e["offset"]) for e in index_entries(path)] == [(3, 2 * line)]
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def test_index_can_be_turned_off(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    exp = JSONLExporter(path, index=False, modules_every=1)
    export_all(exp, [make_report(1)])
    exp.shutdown()
    assert os.listdir(tmp_path) == ["run.jsonl"]
    with pytest.raises(TypeError):
        JSONLExporter(path, index=1, modules_every=1)  # type: ignore[arg-type]


def test_lines_carry_module_snapshots_where_a_module_peak_moved(tmp_path: Path) -> None:
    """The budget's change rule, step by step: a line carries the module snapshots when a module's
    forward or backward peak (max over calls and devices) moved by more than 5% and 64 KiB since
    the last line that carried them."""
    from fsdp_mem_otel.schema import PEAK_BACKWARD, PEAK_FORWARD

    mib, kib = 2**20, 2**10

    def report(step: int, peaks: dict[str, tuple[list[int], int]]) -> StepReport:
        r = make_report(step, n_modules=1)
        r.modules = {}
        for key, (forward_calls, backward) in peaks.items():
            mod = ModuleReport({s: [{"cuda:0": {"total": 1}}] for s in STATES}, {s: [step] for s in STATES})
            # one call per forward total, the larger on another device
            mod.snapshots[PEAK_FORWARD] = [{"cuda:0": {"total": 7}, "cuda:1": {"total": t}} for t in forward_calls]
            mod.snapshots[PEAK_BACKWARD] = [{"cuda:0": {"total": backward}}]
            r.modules[key] = mod
        r.module_order = list(peaks)
        return r

    big, small = "layers.0", "layers.1"
    steps = [
        {big: ([10 * mib], 20 * mib), small: ([100 * kib], 100 * kib)},  # 1: the first line
        {big: ([10 * mib + 400 * kib], 20 * mib), small: ([100 * kib], 100 * kib)},  # 2: +400 KiB < 5%
        {big: ([10 * mib + 600 * kib], 20 * mib), small: ([100 * kib], 100 * kib)},  # 3: +600 KiB > 5%
        {big: ([10 * mib + 600 * kib], 20 * mib - 1100 * kib), small: ([100 * kib], 100 * kib)},  # 4: backward
        {big: ([10 * mib + 600 * kib], 20 * mib - 1100 * kib), small: ([150 * kib], 100 * kib)},  # 5: +50 KiB
        {big: ([10 * mib + 600 * kib], 20 * mib - 1100 * kib), small: ([170 * kib], 100 * kib)},  # 6: +70 KiB
        {big: ([10 * mib + 600 * kib, 12 * mib], 20 * mib - 1100 * kib),  # 7: a second, larger call
         small: ([170 * kib], 100 * kib)},
        {big: ([12 * mib, 10 * mib], 20 * mib - 1100 * kib), small: ([170 * kib], 100 * kib)},  # 8: same max
        {big: ([12 * mib, 10 * mib], 20 * mib - 1100 * kib)},  # 9: a module gone
    ]
    reports = [report(i, peaks) for i, peaks in enumerate(steps, 1)]
    path = tmp_path / "run.jsonl"
    exp = JSONLExporter(path, modules_every=1000)
    export_all(exp, reports)
    exp.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["step"] for x in lines if "modules_from" not in x] == [1, 3, 4, 6, 7, 9]
    assert [x.get("modules_from") for x in lines] == [None, 1, None, None, 4, None, None, 7, None]
    for got, sent in zip(read_reports(path), reports, strict=True):  # filled in from the carrying line
        source = reports[got.modules_from - 1] if got.modules_from is not None else sent
        assert got.to_dict()["modules"] == source.to_dict()["modules"]


def test_a_line_is_the_reports_json() -> None:
    """A line reads back as the report's dict; it is ``json.dumps(sort_keys=True)``'s text but for
    the value of "modules", which orjson writes (compact); a line without modules is exactly it."""
    for report in (make_report(3), make_report(4, aborted=True)):
        _, line = jsonl_format.encode(report)
        assert json.loads(line) == report.to_dict()
        reference = (json.dumps(report.to_dict(), sort_keys=True) + "\n").encode()
        start, end = reference.index(b'"modules": '), reference.rindex(b', "peak": ')
        assert line.startswith(reference[:start]) and line.endswith(reference[end:])  # the layout scan reads
        modules = line[start + len(b'"modules": ') : len(line) - (len(reference) - end)]
        assert json.loads(modules) == report.to_dict()["modules"]
        options = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
        assert modules == orjson.dumps(report.to_dict()["modules"], option=options)  # compact, sorted
        sparse = copy.copy(report)
        sparse.modules, sparse.module_order, sparse.modules_from = {}, [], 1
        assert jsonl_format.encode(sparse)[1] == (json.dumps(sparse.to_dict(), sort_keys=True) + "\n").encode()


@pytest.mark.parametrize("with_orjson", [True, False])
def test_lines_read_back_as_json_dumps_wrote_them(monkeypatch: pytest.MonkeyPatch, with_orjson: bool) -> None:
    """A line parses to what ``json.dumps`` of the report parses to, whatever the modules hold. What
    orjson would write differently (NaN and the infinities: null, where json.dumps writes NaN,
    Infinity, -Infinity) or refuses (integers past 64 bits, a lone surrogate) is left to json.dumps,
    as is a text with "null" in it: that line is json.dumps' own. Non-finite step-level figures
    (allocator statistics, floats) are json.dumps' text on every line. Without orjson, json.dumps
    writes every line."""
    if not with_orjson:
        monkeypatch.setattr(jsonl_format, "_orjson", None)
    nan, inf = float("nan"), float("inf")
    # (a module's key, a byte count in its snapshots), and whether json.dumps writes that line
    cases = [("layers.9", 12345, False), ("layers.9", -0.0, False), ("layers.9", 1e-300, False),
             ("\u00e9t\u00e9 \"x\"", 1, False), ("layers.9", nan, True), ("layers.9", inf, True),
             ("layers.9", -inf, True), ("layers.9", 2**64, True), ("layers.9", -(2**70), True),
             ("\ud800", 1, True), ("null", 1, True)]
    for key, value, whole in cases:
        report = make_report(5)
        report.allocator["cuda:0"]["fragmentation_ratio"] = nan  # step-level: NaN, as json.dumps writes it
        report.modules[key] = ModuleReport({STATES[0]: [{"cpu": {CATEGORY_KEYS[0]: value}}]}, {STATES[0]: [2]})
        _, line = jsonl_format.encode(report)
        reference = (json.dumps(report.to_dict(copy=False), sort_keys=True) + "\n").encode()
        # parsed alike (compared as text: NaN != NaN)
        assert json.dumps(json.loads(line), sort_keys=True) == json.dumps(json.loads(reference), sort_keys=True)
        assert (line == reference) == (whole or not with_orjson), (key, value)
        assert b'"fragmentation_ratio": NaN' in line
        parsed = json.loads(line)
        assert repr(parsed["modules"][key]["snapshots"][STATES[0]][0]["cpu"][CATEGORY_KEYS[0]]) == repr(value)
        back = StepReport.from_dict({**parsed, "modules": {}})
        assert math.isnan(back.allocator["cuda:0"]["fragmentation_ratio"])
