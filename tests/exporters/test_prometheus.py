# ruff: noqa: E501 - the exact exposition below has the long lines Prometheus writes
"""Prometheus exporter: exact exposition of synthetic reports, catalog rules, cardinality, faults,
and a real 2-rank FSDP2 run scraped over HTTP, mutual TLS and through the sidecar server."""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from fsdp_mem_otel.exporters.prometheus import PrometheusExporter, StepReportCollector
from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import (
    CATEGORY_KEYS,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    STATES,
    LeakReport,
    ModuleReport,
    StepAbort,
    StepReport,
)
from tests.dist import free_ports, run_ranks
from tests.exporters import prom_workers

ALLOCATOR_KEYS = (
    "allocated_bytes", "allocated_peak_bytes", "reserved_bytes", "reserved_peak_bytes", "active_bytes",
    "active_peak_bytes", "inactive_split_bytes", "device_total_bytes", "num_alloc_retries", "num_ooms",
    "fragmentation_ratio", "untracked_bytes", "outside_pytorch_bytes", "resident_bytes",
)
IDENTITY = Identity("train", 1, 1, 2, "host", pod="train-1", namespace="ml")


def small_report() -> StepReport:
    peak = {"cuda:0": dict(zip(CATEGORY_KEYS, [1024, 0, 64, 1024, 0, 4096, 512, 0, 0, 2048, 256, 8960], strict=True))}
    cur = {"cuda:0": dict(zip(CATEGORY_KEYS, [1024, 0, 64, 1024, 0, 0, 0, 0, 0, 2048, 0, 4160], strict=True))}
    alloc: dict[str, dict[str, float]] = {
        "cuda:0": {"allocated_bytes": 5000, "reserved_bytes": 8192, "num_alloc_retries": 2, "fragmentation_ratio": 0.25},
        "cpu": {"resident_bytes": 123456789},
    }
    mods = {
        "<root>": ModuleReport(
            {"peak_forward": [{"cuda:0": {"total": 7000}}], "peak_backward": [{"cuda:0": {"total": 8960}}]},
            {"before_pre_forward": [1_000_000_000], "after_post_forward": [1_250_000_000]},
        ),
        "layers.0": ModuleReport(  # called twice: peak is the max, time the sum
            {"peak_forward": [{"cuda:0": {"total": 6000}}, {"cuda:0": {"total": 6500}}]},
            {"before_pre_forward": [1_000_000_000, 1_100_000_000], "after_post_forward": [1_020_000_000, 1_130_000_000]},
        ),
    }
    return StepReport(
        step=7, rank=1, world_size=2, mode="deep", fsdp_version=2, peak=peak, modules=mods,
        module_order=["<root>", "layers.0"], current=cur, allocator=alloc, local_rank=1, duration_seconds=0.5,
        tracker_overhead_seconds=0.125, errors_total=1, timestamp=1700000000.5,
    )


def big_report(n_modules: int = 100) -> StepReport:
    """Every state of every module, two devices, every allocator statistic."""
    b = {dev: {c: 1000 + i for i, c in enumerate(CATEGORY_KEYS)} for dev in ("cuda:0", "cpu")}
    keys = ["<root>"] + [f"layers.{i}" for i in range(n_modules - 1)]
    times = {s: [10, 20] for s in STATES}
    mods = {k: ModuleReport({s: [b, b] for s in STATES}, dict(times)) for k in keys}
    alloc: dict[str, dict[str, float]] = {"cuda:0": {k: 1.0 for k in ALLOCATOR_KEYS if k != "resident_bytes"}, "cpu": {"resident_bytes": 1.0}}
    oom = StepAbort("OutOfMemoryError", "CUDA out of memory", True, keys[-1], "after_pre_forward", b,
                    outside_pytorch_bytes={"cuda:0": 1})
    leak = LeakReport(growing={"activation": 128.0, "total": 128.0}, held={keys[-1]: 4096}, steps=12)
    return StepReport(step=1, rank=0, world_size=2, mode="light", fsdp_version=1, peak=b, modules=mods,
                      module_order=keys, current=b, allocator=alloc, aborted=oom, leak=leak)


def exposition(report: StepReport | None, identity: Identity = IDENTITY, detail: bool = False,
               estimate: StepReport | None = None) -> str:
    registry = CollectorRegistry()
    collector = StepReportCollector(identity, detail=detail)
    collector.estimate = estimate
    registry.register(collector)
    if report is not None:
        collector.update(report)
    return generate_latest(registry).decode()


def samples(text: str) -> list[Any]:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(text: str, name: str, **labels: str) -> float:
    found = [s.value for s in samples(text) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return float(found[0])


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    res = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (res.stdout, res.stderr)


EXPECTED = """\
# HELP fsdp_mem_step_peak_bytes Bytes per category at the moment of the last step's peak total on the device (category total = the peak).
# TYPE fsdp_mem_step_peak_bytes gauge
fsdp_mem_step_peak_bytes{category="sharded_param",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 1024.0
fsdp_mem_step_peak_bytes{category="unsharded_param",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_step_peak_bytes{category="buffer",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 64.0
fsdp_mem_step_peak_bytes{category="sharded_grad",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 1024.0
fsdp_mem_step_peak_bytes{category="unsharded_grad",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_step_peak_bytes{category="activation",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 4096.0
fsdp_mem_step_peak_bytes{category="temp",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 512.0
fsdp_mem_step_peak_bytes{category="all_gather",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_step_peak_bytes{category="reduce_scatter",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_step_peak_bytes{category="optimizer_state",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 2048.0
fsdp_mem_step_peak_bytes{category="inputs",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 256.0
fsdp_mem_step_peak_bytes{category="total",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 8960.0
# HELP fsdp_mem_current_bytes Bytes per category live on the device at the end of the last step.
# TYPE fsdp_mem_current_bytes gauge
fsdp_mem_current_bytes{category="sharded_param",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 1024.0
fsdp_mem_current_bytes{category="unsharded_param",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_current_bytes{category="buffer",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 64.0
fsdp_mem_current_bytes{category="sharded_grad",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 1024.0
fsdp_mem_current_bytes{category="unsharded_grad",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_current_bytes{category="activation",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_current_bytes{category="temp",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_current_bytes{category="all_gather",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_current_bytes{category="reduce_scatter",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_current_bytes{category="optimizer_state",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 2048.0
fsdp_mem_current_bytes{category="inputs",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_current_bytes{category="total",device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 4160.0
# HELP fsdp_mem_allocator_allocated_bytes Bytes the device allocator has handed out to tensors, at the end of the last step.
# TYPE fsdp_mem_allocator_allocated_bytes gauge
fsdp_mem_allocator_allocated_bytes{device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 5000.0
# HELP fsdp_mem_allocator_reserved_bytes Bytes the caching allocator holds from the device (allocated plus cached), at the end of the last step.
# TYPE fsdp_mem_allocator_reserved_bytes gauge
fsdp_mem_allocator_reserved_bytes{device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 8192.0
# HELP fsdp_mem_allocator_alloc_retries_total Allocations that failed, freed the allocator cache and were retried (cudaMalloc retries).
# TYPE fsdp_mem_allocator_alloc_retries_total counter
fsdp_mem_allocator_alloc_retries_total{device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 2.0
# HELP fsdp_mem_allocator_fragmentation_ratio Share of reserved bytes not allocated to tensors (1 - allocated / reserved), at the end of the last step.
# TYPE fsdp_mem_allocator_fragmentation_ratio gauge
fsdp_mem_allocator_fragmentation_ratio{device="cuda:0",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.25
# HELP fsdp_mem_process_resident_bytes Resident set size of the training process (host memory).
# TYPE fsdp_mem_process_resident_bytes gauge
fsdp_mem_process_resident_bytes{device="cpu",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 1.23456789e+08
# HELP fsdp_mem_steps_total Training steps the tracker has closed.
# TYPE fsdp_mem_steps_total counter
fsdp_mem_steps_total{job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 7.0
# HELP fsdp_mem_errors_total Internal failures, by component (tracker; exporter: this exporter's I/O and server failures); never raised.
# TYPE fsdp_mem_errors_total counter
fsdp_mem_errors_total{component="tracker",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 1.0
fsdp_mem_errors_total{component="exporter",job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
# HELP fsdp_mem_step_overhead_seconds Time in the tracker's module-state hooks (one call in 13 timed, counted for each) and its deferred accounting during the last step: a lower bound (FSDP group and saved-tensor hooks are not timed).
# TYPE fsdp_mem_step_overhead_seconds gauge
fsdp_mem_step_overhead_seconds{job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.125
# HELP fsdp_mem_tracker_overhead_seconds_total Time in the tracker's module-state hooks (one call in 13 timed, counted for each) and its deferred accounting over all exported steps: a lower bound (FSDP group and saved-tensor hooks are not timed).
# TYPE fsdp_mem_tracker_overhead_seconds_total counter
fsdp_mem_tracker_overhead_seconds_total{job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.125
# HELP fsdp_mem_last_step_timestamp_seconds Unix time at which the last step closed.
# TYPE fsdp_mem_last_step_timestamp_seconds gauge
fsdp_mem_last_step_timestamp_seconds{job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 1.7000000005e+09
# HELP fsdp_mem_step_duration_seconds Wall-clock duration of the last step (between two tracker.step() calls).
# TYPE fsdp_mem_step_duration_seconds gauge
fsdp_mem_step_duration_seconds{job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.5
# HELP fsdp_mem_step_deep 1 when the last step ran in deep mode (every op accounted), 0 in light mode.
# TYPE fsdp_mem_step_deep gauge
fsdp_mem_step_deep{job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 1.0
# HELP fsdp_mem_tracker_info Always 1; labels say the FSDP generation, the fsdp_mem_otel version and the node the rank runs on (NODE_NAME, else the host name).
# TYPE fsdp_mem_tracker_info gauge
fsdp_mem_tracker_info{fsdp_version="2",job_name="train",local_rank="1",namespace="ml",node="host",pod="train-1",rank="1",version="0.1.0",world_size="2"} 1.0
# HELP fsdp_mem_aborted_steps_total Steps stopped early by an exception (kind=oom for out-of-memory, kind=error otherwise).
# TYPE fsdp_mem_aborted_steps_total counter
fsdp_mem_aborted_steps_total{job_name="train",kind="error",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_aborted_steps_total{job_name="train",kind="oom",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
# HELP fsdp_mem_deep_steps_skipped_total Steps due to run deep that stayed light (reason=compiled: the model runs code compiled by torch.compile).
# TYPE fsdp_mem_deep_steps_skipped_total counter
fsdp_mem_deep_steps_skipped_total{job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",reason="compiled",world_size="2"} 0.0
# HELP fsdp_mem_setup_warning 1 while the tracker has found this problem with what it measures, else 0: kind=optimizer_no_state (the optimizer stepped with gradients present and holds no state, so optimizer_state reads 0), kind=nothing_sharded (a multi-rank job whose FSDP shard groups all have one rank).
# TYPE fsdp_mem_setup_warning gauge
fsdp_mem_setup_warning{job_name="train",kind="optimizer_no_state",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
fsdp_mem_setup_warning{job_name="train",kind="nothing_sharded",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
# HELP fsdp_mem_light_fallback_groups FSDP groups light mode accounts per tensor because their own events cannot tell their buffers' bytes (a parameter with a gradient in some steps only, all-gather extensions); 0 on every tested configuration.
# TYPE fsdp_mem_light_fallback_groups gauge
fsdp_mem_light_fallback_groups{job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.0
# HELP fsdp_mem_module_peak_bytes Peak total bytes during the module's forward or backward in the last step (max over calls and devices).
# TYPE fsdp_mem_module_peak_bytes gauge
fsdp_mem_module_peak_bytes{job_name="train",local_rank="1",module="<root>",namespace="ml",phase="forward",pod="train-1",rank="1",world_size="2"} 7000.0
fsdp_mem_module_peak_bytes{job_name="train",local_rank="1",module="<root>",namespace="ml",phase="backward",pod="train-1",rank="1",world_size="2"} 8960.0
fsdp_mem_module_peak_bytes{job_name="train",local_rank="1",module="layers.0",namespace="ml",phase="forward",pod="train-1",rank="1",world_size="2"} 6500.0
# HELP fsdp_mem_module_forward_seconds Wall-clock time of the module's forward in the last step, summed over its calls.
# TYPE fsdp_mem_module_forward_seconds gauge
fsdp_mem_module_forward_seconds{job_name="train",local_rank="1",module="<root>",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.25
fsdp_mem_module_forward_seconds{job_name="train",local_rank="1",module="layers.0",namespace="ml",pod="train-1",rank="1",world_size="2"} 0.05
"""


# -- exact exposition (fresh registry, as client_python's own tests do) ----------------------------
def test_exact_exposition() -> None:
    assert exposition(small_report()) == EXPECTED


def test_exact_exposition_of_an_ended_rank() -> None:
    """The last exposition of a rank whose exporter shut down: the same, plus its end."""
    registry = CollectorRegistry()
    collector = StepReportCollector(IDENTITY)
    registry.register(collector)
    collector.update(small_report())
    collector.end = ("sigterm", 1700000123.5)
    end = (
        "# HELP fsdp_mem_rank_end_timestamp_seconds Unix time at which the rank's exporter shut down, by reason: "
        "clean (tracker.close(), interpreter exit, a framework's end-of-training hook), sigterm (SIGTERM: "
        "preemption, eviction), error (an uncaught exception or a framework's exception hook). Absent while the "
        "rank runs.\n"
        "# TYPE fsdp_mem_rank_end_timestamp_seconds gauge\n"
        'fsdp_mem_rank_end_timestamp_seconds{job_name="train",local_rank="1",namespace="ml",pod="train-1",rank="1",'
        'reason="sigterm",world_size="2"} 1.7000001235e+09\n'
    )
    info_end = EXPECTED.index("# HELP fsdp_mem_aborted_steps_total")
    assert generate_latest(registry).decode() == EXPECTED[:info_end] + end + EXPECTED[info_end:]


def test_oom_step_counts_and_keeps_where_it_happened() -> None:
    registry = CollectorRegistry()
    collector = StepReportCollector(IDENTITY)
    registry.register(collector)
    first = small_report()
    breakdown = {"cpu": {c: 10 * i for i, c in enumerate(CATEGORY_KEYS)}}
    first.aborted = StepAbort("OutOfMemoryError", "CUDA out of memory", True, "layers.1", "after_pre_forward",
                              breakdown)
    collector.update(first)
    second = small_report()
    second.step += 1
    second.aborted = StepAbort("ValueError", "bad batch", False, "<root>", "before_pre_forward", {})
    second.deep_skipped = "compiled"
    collector.update(second)
    collector.update(second)  # the same step twice counts once
    text = generate_latest(registry).decode()
    assert value(text, "fsdp_mem_aborted_steps_total", kind="oom") == 1
    assert value(text, "fsdp_mem_aborted_steps_total", kind="error") == 1
    assert value(text, "fsdp_mem_deep_steps_skipped_total", reason="compiled") == 1
    assert value(text, "fsdp_mem_last_oom_timestamp_seconds", module="layers.1", state="after_pre_forward") \
        == first.timestamp
    for c in CATEGORY_KEYS:
        assert value(text, "fsdp_mem_last_oom_bytes", device="cpu", category=c) == breakdown["cpu"][c]
    promtool_check(text)


def test_before_first_step_only_health_series() -> None:
    text = exposition(None, Identity("j", 0, 0, 1, "h"))
    assert {s.name for s in samples(text)} == {"fsdp_mem_steps_total", "fsdp_mem_errors_total",
                                               "fsdp_mem_tracker_overhead_seconds_total", "fsdp_mem_tracker_info",
                                               "fsdp_mem_aborted_steps_total",
                                               "fsdp_mem_deep_steps_skipped_total"}
    assert value(text, "fsdp_mem_steps_total") == 0
    promtool_check(text)


def test_promtool_and_openmetrics_accept_exposition() -> None:
    for detail in (False, True):
        promtool_check(exposition(big_report(5), detail=detail))
    promtool_check(exposition(small_report()))
    # OpenMetrics names counter families without _total: a clash with a gauge would fail here.
    registry = CollectorRegistry()
    collector = StepReportCollector(IDENTITY, detail=True)
    registry.register(collector)
    collector.update(big_report(3))
    families = list(parse_openmetrics(generate_openmetrics(registry).decode()))
    assert len({f.name for f in families}) == len(families)


# -- catalog ------------------------------------------------------------------------------------
def test_catalog_rules() -> None:
    names = cat.all_names()
    assert len(names) == len(set(names))
    for m in cat.METRICS:
        assert m.name.startswith("fsdp_mem_")
        assert (m.type == cat.COUNTER) == m.name.endswith("_total")
        assert m.name == m.name.lower() and " " not in m.name
        assert not set(m.labels) & set(cat.IDENTITY_LABELS) or m.scope == cat.SCOPE_SIDECAR
        assert "job" not in m.all_labels  # Prometheus owns "job"
    assert set(cat.ALLOCATOR_METRICS) == set(ALLOCATOR_KEYS)
    assert cat.ALLOCATOR_METRICS["num_alloc_retries"].type == cat.COUNTER
    assert cat.ALLOCATOR_METRICS["num_ooms"].type == cat.COUNTER
    assert cat.metric("fsdp_mem_step_peak_bytes") is cat.STEP_PEAK_BYTES
    assert cat.selector(cat.STEP_PEAK_BYTES, category="total") == 'fsdp_mem_step_peak_bytes{category="total"}'
    assert set(cat.all_names(cat.SCOPE_SIDECAR)) == {
        "fsdp_mem_sidecar_rank_last_update_timestamp_seconds", "fsdp_mem_sidecar_rank_stale",
        "fsdp_mem_sidecar_read_errors_total", "fsdp_mem_sidecar_refused_files_total",
        "fsdp_mem_sidecar_directory_readable"}
    with pytest.raises(KeyError, match="unknown metric"):
        cat.metric("fsdp_mem_nope")
    with pytest.raises(ValueError, match="_total"):
        cat.Metric("fsdp_mem_x", cat.COUNTER, "", "X.")
    with pytest.raises(ValueError, match="suffix"):
        cat.Metric("fsdp_mem_x", cat.GAUGE, cat.BYTES, "X.")


def test_collector_emits_exactly_the_catalog() -> None:
    for detail in (False, True):
        text = exposition(big_report(4), detail=detail)
        emitted = {f.name for f in text_string_to_metric_families(text)}
        # the text parser names counter families without _total
        expected = {m.name[:-6] if m.type == cat.COUNTER else m.name for m in cat.METRICS
                    if m.name in cat.exported_names(detail)}
        assert emitted == expected
        for s in samples(text):
            m = cat.metric(s.name)
            assert set(s.labels) == set(IDENTITY.labels()) | set(m.labels), s


# -- cardinality budget -------------------------------------------------------------------------
def test_cardinality_budget_100_modules() -> None:
    text = exposition(big_report(100))
    per_module = [s for s in samples(text) if cat.metric(s.name).scope == cat.SCOPE_MODULE]
    other = [s for s in samples(text) if cat.metric(s.name).scope != cat.SCOPE_MODULE]
    assert len({s.labels["module"] for s in per_module}) == 100
    assert len(per_module) <= cat.MAX_SERIES_PER_MODULE * 100
    assert len(other) <= cat.MAX_OTHER_SERIES
    detailed = [line for line in exposition(big_report(100), detail=True).splitlines() if not line.startswith("#")]
    assert len(detailed) > len(per_module) + len(other)
    state_bytes = [line for line in detailed if line.startswith("fsdp_mem_module_state_bytes{")]
    # the detail budget: top-K modules x states x devices x categories
    assert len(state_bytes) == cat.DEFAULT_DETAIL_TOP_K * len(STATES) * 2 * len(CATEGORY_KEYS)
    assert value("\n".join(detailed), "fsdp_mem_detail_modules_omitted") == 100 - cat.DEFAULT_DETAIL_TOP_K


def test_detail_keeps_the_modules_with_the_largest_peaks() -> None:
    report = big_report(20)
    rng = random.Random(7)
    peaks = {}
    for key, mod in report.modules.items():
        fwd, bwd = rng.randrange(1, 10**6), rng.randrange(1, 10**6)
        peaks[key] = max(fwd, bwd)
        for state, total in ((PEAK_FORWARD, fwd), (PEAK_BACKWARD, bwd)):
            mod.snapshots[state] = [{"cuda:0": {**b["cuda:0"], "total": total}, "cpu": b["cpu"]}
                                    for b in mod.snapshots[state]]
    for k in (1, 5, 20, 50):
        registry = CollectorRegistry()
        collector = StepReportCollector(IDENTITY, detail=True, detail_top_k=k)
        registry.register(collector)
        collector.update(report)
        text = generate_latest(registry).decode()
        detailed = {s.labels["module"] for s in samples(text) if s.name == "fsdp_mem_module_state_bytes"}
        assert detailed == set(sorted(peaks, key=lambda key: -peaks[key])[:k])
        assert value(text, "fsdp_mem_detail_modules_omitted") == max(0, 20 - k)
        # the default series stay for every module
        assert len({s.labels["module"] for s in samples(text) if s.name == "fsdp_mem_module_peak_bytes"}) == 20
    with pytest.raises(ValueError, match="detail_top_k"):
        StepReportCollector(IDENTITY, detail=True, detail_top_k=0)


# -- exporter behaviour -------------------------------------------------------------------------
def test_no_torch_import() -> None:
    code = (
        "import sys; import fsdp_mem_otel.exporters.prometheus, fsdp_mem_otel.fleet.serve, fsdp_mem_otel.fleet.catalog; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_http_endpoint_and_idempotent_shutdown() -> None:
    exp = PrometheusExporter(IDENTITY, port=0, addr="127.0.0.1")
    assert exp.port
    exp.export(small_report())
    text = prom_workers.get(f"http://127.0.0.1:{exp.port}/metrics")
    assert text == EXPECTED
    exp.shutdown()
    exp.shutdown()
    exp.export(small_report())  # after shutdown: ignored, no raise
    assert prom_workers.try_get(f"http://127.0.0.1:{exp.port}/metrics") != "ok"


def test_default_port_is_base_plus_local_rank() -> None:
    base = free_ports(2)
    exp = PrometheusExporter(Identity("j", 5, 1, 8, "h"), base_port=base, addr="127.0.0.1")
    try:
        assert exp.port == base + 1
    finally:
        exp.shutdown()


def test_port_taken_is_counted_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="fsdp_mem_otel"):
            exp = PrometheusExporter(IDENTITY, port=port, addr="127.0.0.1")
        assert exp.port is None and exp.errors_total == 1
        (record,) = [r for r in caplog.records if "in use" in r.getMessage()]  # one line, no traceback
        assert record.getMessage() == (f"fsdp_mem_otel: Prometheus port {port} on 127.0.0.1 is in use: metrics "
                                       "endpoint off for this rank; pass a free port (0: any free one) or http=False")
        assert record.exc_info is None
        exp.export(small_report())
        assert value(generate_latest(exp.registry).decode(), "fsdp_mem_errors_total", component="exporter") == 1
        exp.shutdown()


def test_sidecar_file_atomic_modes_and_recovery(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the directory should be")
    target = blocker / "metrics"
    exp = PrometheusExporter(IDENTITY, http=False, sidecar_dir=target)
    with caplog.at_level(logging.WARNING, logger="fsdp_mem_otel"):
        for _ in range(3):
            exp.export(small_report())
            assert exp.flush() is False
        assert exp.errors_total == 3
        assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1  # logged once
        blocker.unlink()  # the fault clears
        exp.export(small_report())
        assert exp.flush() is True
        assert len([r for r in caplog.records if "works again" in r.getMessage()]) == 1
    path = target / "rank-1.prom"
    text = path.read_text()
    assert value(text, "fsdp_mem_errors_total", component="exporter") == 3
    # the same step exported 4 times counts its overhead once; else the file is the exposition
    assert text.replace("} 3.0\n", "} 0.0\n", 1) == EXPECTED
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(target) == ["rank-1.prom"]  # no temp files left
    exp.shutdown()
    exp.shutdown()


def test_sidecar_reader_never_sees_half_a_file(tmp_path: Path) -> None:
    exp = PrometheusExporter(IDENTITY, http=False, sidecar_dir=tmp_path, detail=True)
    report = big_report(8)  # ~500 KiB of exposition per write
    exp.export(report)
    assert exp.flush()
    path = tmp_path / "rank-1.prom"
    full = path.read_text()
    stop = threading.Event()
    bad: list[int] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            if path.read_text() != full:
                bad.append(1)
            reads[0] += 1

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(20):
        exp.export(report)
        exp.flush()
    stop.set()
    t.join()
    exp.shutdown()
    assert reads[0] > 0 and not bad


def test_export_never_raises_on_malformed_report(caplog: pytest.LogCaptureFixture) -> None:
    exp = PrometheusExporter(IDENTITY, http=False)
    broken = small_report()
    broken.peak = None  # type: ignore[assignment]
    exp.export(broken)
    with caplog.at_level(logging.ERROR, logger="fsdp_mem_otel"):
        text = generate_latest(exp.registry).decode()
    assert value(text, "fsdp_mem_errors_total", component="exporter") == 1
    assert "fsdp_mem_step_peak_bytes" not in text
    exp.export(small_report())  # the next good report is served in full
    assert "fsdp_mem_step_peak_bytes" in generate_latest(exp.registry).decode()
    exp.shutdown()


def test_overhead_total_counts_each_step_once() -> None:
    registry = CollectorRegistry()
    collector = StepReportCollector(IDENTITY)
    registry.register(collector)
    first, second = small_report(), small_report()
    second.step = 8
    for report in (first, first, second):  # the same step exported twice counts once
        collector.update(report)
    text = generate_latest(registry).decode()
    assert value(text, "fsdp_mem_tracker_overhead_seconds_total") == 0.25
    assert value(text, "fsdp_mem_steps_total") == 8


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="certfile and keyfile"):
        PrometheusExporter(IDENTITY, certfile="c.pem", http=False)
    with pytest.raises(ValueError, match="client_cafile"):
        PrometheusExporter(IDENTITY, client_cafile="ca.pem", http=False)
    with pytest.raises(ValueError, match="port"):
        PrometheusExporter(IDENTITY, port=70000)
    with pytest.raises(TypeError, match="registry"):
        PrometheusExporter(IDENTITY, registry=object(), http=False)  # type: ignore[arg-type]


# -- real: 2 ranks, FSDP2, HTTP + mutual TLS + sidecar --------------------------------------------
@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("prom_real")
    tls = prom_workers.make_tls(tmp)
    base, tls_base, sidecar_port = free_ports(2), free_ports(2), free_ports(1)
    assert len({base, base + 1, tls_base, tls_base + 1, sidecar_port}) == 5
    sidecar_dir = str(tmp / "sidecar")
    results = run_ranks(prom_workers.train_scrape_and_serve, base, tls_base, sidecar_dir, sidecar_port, tls,
                        timeout=240)
    return {"ranks": results, "base": base, "tls_base": tls_base, "dir": sidecar_dir}


def _check_rank_text(text: str, report: dict[str, Any], job: str) -> None:
    r = str(report["rank"])
    ident = {"job_name": job, "rank": r, "local_rank": r, "world_size": "2"}
    for s in samples(text):
        assert {k: s.labels.get(k) for k in ident} == ident, s
    for c in CATEGORY_KEYS:
        assert value(text, "fsdp_mem_step_peak_bytes", device="cpu", category=c) == report["peak"]["cpu"][c]
        assert value(text, "fsdp_mem_current_bytes", device="cpu", category=c) == report["current"]["cpu"][c]
    assert report["peak"]["cpu"]["total"] > 0
    assert value(text, "fsdp_mem_steps_total") == prom_workers.STEPS == report["step"]
    assert value(text, "fsdp_mem_errors_total", component="tracker") == report["errors_total"] == 0
    assert value(text, "fsdp_mem_errors_total", component="exporter") == 0
    assert value(text, "fsdp_mem_tracker_info", fsdp_version="2") == 1
    assert value(text, "fsdp_mem_last_step_timestamp_seconds") == report["timestamp"]
    sr = StepReport.from_dict(report)
    assert sr.modules.keys() == {"<root>", "layers.0", "layers.1", "layers.2"}
    for key, mod in sr.modules.items():
        for phase, state in (("forward", "peak_forward"), ("backward", "peak_backward")):
            assert value(text, "fsdp_mem_module_peak_bytes", module=key, phase=phase) == mod.peak_total(state) > 0


def test_real_ranks_scraped_over_http(real_run: dict[str, Any]) -> None:
    ranks = real_run["ranks"]
    for r, out in enumerate(ranks):
        assert out["ports"] == (real_run["base"] + r, real_run["tls_base"] + r)
        assert out["flushed"] and out["flushed_again"]
        assert out["errors_total"] == (0, 0)
    for endpoint in range(2):
        report = ranks[endpoint]["reports"][-1]
        # each rank scraped both endpoints; the last report was served the same to both
        assert ranks[0]["scrapes"][endpoint] == ranks[1]["scrapes"][endpoint]
        assert ranks[endpoint]["job"] == "fsdp" or os.environ.get("FSDP_MEM_OTEL_JOB") or os.environ.get(
            "TORCHELASTIC_RUN_ID")  # no job configured: the default name
        _check_rank_text(ranks[0]["scrapes"][endpoint], report, ranks[endpoint]["job"])
        promtool_check(ranks[0]["scrapes"][endpoint])


def test_real_ranks_scraped_over_mutual_tls(real_run: dict[str, Any]) -> None:
    for out in real_run["ranks"]:
        for endpoint in range(2):  # same reports, same exposition as the plain endpoint
            assert out["tls_scrapes"][endpoint] == out["scrapes"][endpoint]
        assert out["tls_without_client_cert"] != "ok"
        assert out["plain_http_to_tls_port"] != "ok"


def test_real_sidecar_merges_ranks_and_serves_a_closed_ranks_end(real_run: dict[str, Any]) -> None:
    ranks = real_run["ranks"]
    alive, one_silent = ranks[0]["sidecar_alive"], ranks[0]["sidecar_one_silent"]
    promtool_check(alive)
    assert alive.count("# TYPE fsdp_mem_step_peak_bytes gauge") == 1
    rank_series = {s for s in alive.splitlines() if not s.startswith("#") and "sidecar" not in s}
    per_rank = {line for r in range(2) for line in ranks[0]["scrapes"][r].splitlines() if not line.startswith("#")}
    assert rank_series == per_rank  # every series of both ranks, each once, same values
    for r in range(2):
        labels = {"rank": str(r), "job_name": ranks[r]["job"], "local_rank": str(r), "world_size": "2"}
        assert value(alive, "fsdp_mem_sidecar_rank_stale", **labels) == 0
        assert value(alive, "fsdp_mem_sidecar_rank_last_update_timestamp_seconds", rank=str(r)) > \
            ranks[r]["reports"][-1]["timestamp"] - 1
    assert value(one_silent, "fsdp_mem_sidecar_rank_stale", rank="0") == 0
    # rank 1 closed its tracker: its last file records a clean end, so it is not stale (a killed
    # rank is: tests/fleet/test_rank_death.py), and its last values stay visible with the end
    assert value(one_silent, "fsdp_mem_sidecar_rank_stale", rank="1") == 0
    assert value(one_silent, "fsdp_mem_rank_end_timestamp_seconds", rank="1", reason="clean") >= \
        ranks[1]["reports"][-1]["timestamp"]
    assert not [s for s in samples(one_silent) if s.name == "fsdp_mem_rank_end_timestamp_seconds"
                and s.labels["rank"] == "0"]  # rank 0 still runs
    assert value(one_silent, "fsdp_mem_step_peak_bytes", rank="1", device="cpu", category="total") == \
        ranks[1]["reports"][-1]["peak"]["cpu"]["total"]
    assert ranks[0]["rank1_endpoint_after_close"] != "ok"
    assert sorted(os.listdir(real_run["dir"])) == ["rank-0.prom", "rank-1.prom"]
    assert stat.S_IMODE(os.stat(real_run["dir"]).st_mode) == 0o700




def test_sidecar_rewrites_at_most_every_interval_but_aborts_and_shutdown_at_once(tmp_path: Path) -> None:
    exp = PrometheusExporter(IDENTITY, http=False, sidecar_dir=tmp_path, sidecar_interval_seconds=30)
    rank_file = tmp_path / "rank-1.prom"

    def step(n: int, aborted: bool = False) -> None:
        report = small_report()
        report.step = n
        if aborted:
            report.aborted = StepAbort("OutOfMemoryError", "CUDA out of memory", True, "layers.0", "after_pre_forward",
                                       report.peak)
        exp.export(report)

    def written() -> float:
        return value(rank_file.read_text(), "fsdp_mem_steps_total")

    def wait_for(n: float) -> float:
        deadline = time.monotonic() + 5
        while written() != n and time.monotonic() < deadline:
            time.sleep(0.02)
        return written()

    step(1)
    assert exp.flush(timeout=5) and written() == 1
    for n in range(2, 11):  # a burst inside the interval: not written yet
        step(n)
    time.sleep(0.5)
    assert written() == 1
    step(11, aborted=True)  # an aborted step is written at once (the process may be about to die)
    assert wait_for(11) == 11
    step(12)
    t0 = time.monotonic()
    exp.shutdown()  # the last step is written on shutdown, without waiting out the interval
    assert time.monotonic() - t0 < 5 and written() == 12
    with pytest.raises(ValueError, match="sidecar_interval_seconds"):
        PrometheusExporter(IDENTITY, http=False, sidecar_dir=tmp_path, sidecar_interval_seconds=-1)


def test_a_leak_is_exported_by_category_and_holder() -> None:
    text = exposition(big_report(4))
    assert value(text, "fsdp_mem_leak_growth_bytes_per_step", category="activation") == 128.0
    assert not [s for s in samples(text) if s.labels.get("category") == "inputs"
                and s.name == "fsdp_mem_leak_growth_bytes_per_step"]  # only what grows
    assert "fsdp_mem_leak_growth_bytes_per_step" not in exposition(small_report())
    assert value(text, "fsdp_mem_step_end_held_bytes", module="layers.2") == 4096.0
    promtool_check(text)
