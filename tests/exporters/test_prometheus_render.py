"""The sidecar file's render (``StepReportCollector.exposition``): byte for byte what
prometheus_client's ``generate_latest`` writes for the collector, render after render, with the
series text it keeps between renders following the reports (new values, series gone)."""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

from prometheus_client import generate_latest

from fsdp_mem_otel.exporters.prometheus import PrometheusExporter, StepReportCollector
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import LeakReport
from tests.exporters.test_prometheus import IDENTITY, big_report, small_report, value

#: label values the text format escapes (quote, backslash, newline) and beyond ASCII
ODD = Identity('we"ird\\job\nname', 3, 1, 8, "h\\ost", pod="pod-ü-1", namespace='n"s', node="nöde")


def same(collector: StepReportCollector) -> str:
    text = collector.exposition()
    assert text == generate_latest(collector)
    return text.decode()


def test_every_report_shape_renders_as_generate_latest() -> None:
    estimate = big_report(6)
    for identity in (IDENTITY, ODD):
        for detail in (False, True):
            for with_estimate in (False, True):
                collector = StepReportCollector(identity, detail=detail, detail_top_k=3)
                if with_estimate:
                    collector.estimate = estimate
                same(collector)  # before the first report: the health series only
                for r in (small_report(), big_report(12), small_report(), big_report(5)):
                    collector.update(r)
                    same(collector)
                collector.end = ("sigterm", 1700000123.5)
                same(collector)


def test_a_render_after_a_new_report_has_its_values() -> None:
    collector = StepReportCollector(IDENTITY)
    first = small_report()
    collector.update(first)
    before = same(collector)
    second = copy.deepcopy(first)
    second.step = 8
    second.duration_seconds = 0.75
    second.modules["layers.0"].snapshots["peak_forward"] = [{"cuda:0": {"total": 123456789}}]
    collector.update(second)
    after = same(collector)
    peak = "fsdp_mem_module_peak_bytes"
    assert value(before, peak, module="layers.0", phase="forward") == 6500
    assert value(after, peak, module="layers.0", phase="forward") == 123456789
    assert "} 1.23456789e+08\n" in after and "} 6500.0\n" not in after
    assert value(after, "fsdp_mem_step_duration_seconds") == 0.75
    assert value(after, "fsdp_mem_steps_total") == 8
    collector.update(first)  # and back
    again = same(collector)
    assert value(again, peak, module="layers.0", phase="forward") == 6500
    assert value(again, "fsdp_mem_step_duration_seconds") == 0.5


def test_a_module_that_leaves_the_report_leaves_the_file_and_the_kept_text() -> None:
    collector = StepReportCollector(IDENTITY)
    collector.update(big_report(10))
    assert 'module="layers.8"' in same(collector)
    smaller = big_report(4)
    smaller.step = 2
    smaller.leak = LeakReport(growing={}, held={}, steps=1)
    collector.update(smaller)
    text = same(collector)
    assert 'module="layers.8"' not in text and 'module="layers.2"' in text
    kept = {values for _, values in collector._series}
    assert not any("layers.8" in v for v in kept)
    assert len(collector._series) == sum(1 for line in text.splitlines() if not line.startswith("#"))


def test_signed_zero_nan_and_infinity_are_written_as_generate_latest_writes_them() -> None:
    collector = StepReportCollector(IDENTITY)
    r = small_report()
    for step, x in enumerate((0.0, -0.0, 0.0, math.nan, math.nan, math.inf, -math.inf, 1e-300, 1e300), 8):
        r = copy.copy(r)
        r.step, r.duration_seconds, r.tracker_overhead_seconds = step, x, x
        collector.update(r)
        same(collector)


def test_the_sidecar_file_is_the_exposition(tmp_path: Path) -> None:
    exp = PrometheusExporter(ODD, http=False, sidecar_dir=tmp_path, sidecar_interval_seconds=0)
    for r in (small_report(), big_report(7)):
        exp.export(r)
        assert exp.flush()
        assert (tmp_path / "rank-3.prom").read_bytes() == generate_latest(exp.collector)
    exp.shutdown()


def test_the_writer_waits_out_its_interval_without_polling_and_wakes_at_exit(tmp_path: Path) -> None:
    """Between writes the sidecar writer sleeps in one timed wait (at one step per second it waits
    out nearly every interval: polling cost ~1.7 ms of CPU per second); the worker's own shutdown
    (interpreter exit, SIGTERM: ``worker.shutdown_all``) wakes it and the waiting report is written."""
    exp = PrometheusExporter(IDENTITY, http=False, sidecar_dir=tmp_path, sidecar_interval_seconds=3600)
    first, second = small_report(), small_report()
    second.step = 8
    exp.export(first)
    assert exp.flush()
    exp.export(second)  # waits out the interval
    time.sleep(0.3)
    writer = exp._writer
    assert writer is not None
    t0 = time.monotonic()
    assert writer._worker.shutdown(5)
    assert time.monotonic() - t0 < 2
    assert value((tmp_path / "rank-1.prom").read_text(), "fsdp_mem_steps_total") == 8
    exp.shutdown()
