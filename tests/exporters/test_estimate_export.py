"""An estimate exported beside the measured figures: real scrapes of the per-rank endpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fsdp_mem_otel.config import ExportConfig
from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import CATEGORY_KEYS, PEAK_BACKWARD, PEAK_FORWARD, TOTAL, StepReport
from tests.exporters import prom_workers
from tests.exporters.test_prometheus import promtool_check, samples
from tests.offline.test_report import synthetic, write_jsonl

IDENTITY = Identity("train", 1, 1, 2, "h")


def scrape(exp: PrometheusExporter) -> list:
    text = prom_workers.get(f"http://127.0.0.1:{exp.port}/metrics")
    promtool_check(text)
    return samples(text)


def estimate_of(got: list, name: str, **labels: str) -> dict[tuple[str, ...], float]:
    out = {}
    for s in got:
        if s.name == name and all(s.labels[k] == v for k, v in labels.items()):
            out[tuple(s.labels[k] for k in ("module", "phase") if k in s.labels) or (s.labels["category"],)] = s.value
    return out


def expected_module_peaks(report: StepReport) -> dict[tuple[str, ...], float]:
    """Independently of the exporter: the max over calls and devices of each peak state's total."""
    out = {}
    for key, mod in report.modules.items():
        for phase, state in (("forward", PEAK_FORWARD), ("backward", PEAK_BACKWARD)):
            calls = mod.snapshots.get(state) or []
            if calls:
                out[(key, phase)] = float(max(c[TOTAL] for call in calls for c in call.values()))
    return out


def test_estimate_file_scraped_beside_the_measurement(tmp_path: Path) -> None:
    path = tmp_path / "estimate.jsonl"
    # two ranks' estimates in one file: rank 1 reads its own
    estimates = [synthetic(step=1, rank=0), synthetic(step=1, rank=1)]
    write_jsonl(path, estimates)
    mine = estimates[1]
    exp = PrometheusExporter(IDENTITY, port=0, addr="127.0.0.1", estimate=path)
    try:
        exp.export(synthetic(step=5, rank=1))
        got = scrape(exp)
        dev = "cuda:1"  # synthetic reports live on cuda:<rank>
        assert estimate_of(got, "fsdp_mem_estimate_step_peak_bytes") == {
            (c,): float(mine.peak[dev][c]) for c in CATEGORY_KEYS}
        assert estimate_of(got, "fsdp_mem_estimate_module_peak_bytes") == expected_module_peaks(mine)
        # beside the measured series, with the same identity labels
        measured = [s for s in got if s.name == "fsdp_mem_module_peak_bytes"]
        est = [s for s in got if s.name == "fsdp_mem_estimate_module_peak_bytes"]
        assert {s.labels["module"] for s in est} == {s.labels["module"] for s in measured}
        assert all(s.labels["rank"] == "1" and s.labels["job_name"] == "train" for s in est)
        assert exp.errors_total == 0
    finally:
        exp.shutdown()


def test_estimate_from_the_environment_and_a_report_object(tmp_path: Path) -> None:
    path = tmp_path / "estimate.jsonl"
    write_jsonl(path, [synthetic(step=1, rank=0)])
    config = ExportConfig.from_env({"FSDP_MEM_OTEL_ESTIMATE": str(path), "FSDP_MEM_OTEL_PROMETHEUS": "0"})
    assert config.prometheus_config().estimate == str(path)
    report = synthetic(step=1, rank=0)
    exp = PrometheusExporter(IDENTITY, port=0, addr="127.0.0.1", estimate=report)
    try:
        exp.export(synthetic(step=2, rank=1))
        got = scrape(exp)
        # a file with only another rank's estimate: that one is used (FSDP ranks are symmetric)
        assert estimate_of(got, "fsdp_mem_estimate_module_peak_bytes") == expected_module_peaks(report)
    finally:
        exp.shutdown()


@pytest.mark.parametrize("content", [None, "", "{not json\n"])
def test_unreadable_estimate_is_counted_not_raised(tmp_path: Path, content: str | None,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "estimate.jsonl"
    if content is not None:
        path.write_text(content)
    with caplog.at_level(logging.WARNING):
        exp = PrometheusExporter(IDENTITY, port=0, addr="127.0.0.1", estimate=path)
    try:
        exp.export(synthetic(step=2, rank=1))
        got = scrape(exp)
        assert not [s for s in got if s.name.startswith("fsdp_mem_estimate_")]
        assert exp.errors_total == 1
        assert any(str(path) in r.getMessage() for r in caplog.records)
        errors = [s.value for s in got if s.name == "fsdp_mem_errors_total" and s.labels["component"] == "exporter"]
        assert errors == [1]
    finally:
        exp.shutdown()
