"""Across machines: a node's Prometheus in agent mode scrapes a rank's real endpoint and
remote-writes to a central Prometheus, which evaluates the shipped recording rules; the
dashboards' queries return data from the central one. Two real Prometheus processes, loopback.

The configurations are deploy/remote-write/{agent,central}.yml with the addresses replaced.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.fleet.alerts import (
    REC_JOB_CATEGORY_LEAK,
    REC_JOB_HOURS,
    REC_JOB_MODULE_PEAK,
    REC_JOB_PEAK_MAX,
    REC_JOB_STALE,
    REC_RANK_HOURS,
    REC_RANK_PEAK,
    RECORDED_LABELS,
)
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import LeakReport, StepReport
from tests.dist import free_ports
from tests.exporters.test_prometheus import small_report
from tests.prometheus_server import running_prometheus

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "remote-write"
JOB, NAMESPACE = "remote-write-e2e", "e2e"


def rank_report() -> StepReport:
    """small_report() from a CUDA rank whose allocator reports, as every CUDA rank's does, the
    device's capacity, its OOM count (none yet) and its peaks of the step, and whose activations leak
    (so that the leak panels' recorded series have something to read through the central)."""
    report = small_report()
    report.allocator["cuda:0"].update(num_ooms=0.0, device_total_bytes=80.0 * 2**30, allocated_peak_bytes=9000.0,
                                      active_peak_bytes=9000.0, reserved_peak_bytes=16384.0)
    report.leak = LeakReport(growing={"activation": 4096.0}, held={"layers.0": 8192}, steps=30)
    return report


def _api(base: str, query: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read().decode())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@pytest.fixture(scope="module")
def central(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("remote_write")
    rank_port, agent_port, central_port = free_ports(1), free_ports(1), free_ports(1)
    ident = Identity(JOB, 0, 0, 1, "h", pod=f"{JOB}-0", namespace=NAMESPACE)
    exporter = PrometheusExporter(ident, port=rank_port, addr="127.0.0.1")
    exporter.export(rank_report())

    central_conf = yaml.safe_load((EXAMPLE / "central.yml").read_text())
    central_conf["global"]["evaluation_interval"] = "1s"
    central_conf["rule_files"] = [str(ROOT / "deploy" / "prometheus" / "fsdp-mem-otel.rules.yml")]
    (tmp / "central.yml").write_text(yaml.safe_dump(central_conf))
    agent_conf = yaml.safe_load((EXAMPLE / "agent.yml").read_text())
    agent_conf["global"]["scrape_interval"] = "1s"
    agent_conf["scrape_configs"][0]["static_configs"] = [
        {"targets": [f"127.0.0.1:{rank_port}"], "labels": {"namespace": NAMESPACE}}]
    agent_conf["remote_write"][0]["url"] = f"http://127.0.0.1:{central_port}/api/v1/write"
    (tmp / "agent.yml").write_text(yaml.safe_dump(agent_conf))

    with contextlib.ExitStack() as stack:
        stack.callback(exporter.shutdown)
        central_base = stack.enter_context(running_prometheus(
            tmp / "central.log", central_port, "--web.enable-remote-write-receiver",
            f"--config.file={tmp / 'central.yml'}", f"--storage.tsdb.path={tmp / 'central-data'}"))
        stack.enter_context(running_prometheus(
            tmp / "agent.log", agent_port, "--enable-feature=agent", f"--config.file={tmp / 'agent.yml'}",
            f"--storage.agent.path={tmp / 'agent-data'}"))
        deadline = time.monotonic() + 60
        while not _api(central_base, REC_JOB_MODULE_PEAK):  # written, then recorded centrally
            assert time.monotonic() < deadline, (tmp / "agent.log").read_text() + (tmp / "central.log").read_text()
            time.sleep(0.5)
        time.sleep(4)  # some history: the regression panels compare with $baseline (1s) earlier
        yield central_base


def test_the_agent_keeps_nothing_queryable_and_the_central_has_the_rank(central: str) -> None:
    report = rank_report()
    got = _api(central, f'fsdp_mem_step_peak_bytes{{job_name="{JOB}", category="total"}}')
    assert [float(s["value"][1]) for s in got] == [float(report.peak["cuda:0"]["total"])]
    assert got[0]["metric"]["cluster"] == "train-a"  # the agent's external label came along
    assert got[0]["metric"]["namespace"] == NAMESPACE


def test_recording_rules_and_dashboard_queries_answer_from_the_central(central: str) -> None:
    report = rank_report()
    peak = float(report.peak["cuda:0"]["total"])
    assert [float(s["value"][1]) for s in _api(central, REC_RANK_PEAK)] == [peak]
    assert [float(s["value"][1]) for s in _api(central, REC_JOB_PEAK_MAX)] == [peak]
    modules = {(s["metric"]["module"], s["metric"]["phase"]): float(s["value"][1])
               for s in _api(central, REC_JOB_MODULE_PEAK)}
    expected = {(k, phase): float(m.peak_total(f"peak_{phase}")) for k, m in report.modules.items()
                for phase in ("forward", "backward") if m.snapshots.get(f"peak_{phase}")}
    assert modules == expected
    assert [(s["metric"]["category"], float(s["value"][1])) for s in _api(central, REC_JOB_CATEGORY_LEAK)] == [
        ("activation", 4096.0)]
    # every dashboard query that reads the recorded series answers from the central store, with
    # the dashboards' variables set to this job
    for name in ("fleet-overview.json", "job-drilldown.json"):
        board = json.loads((ROOT / "dashboards" / name).read_text())
        exprs = [_substitute(t["expr"]) for p in _panels(board["panels"]) for t in p.get("targets", [])]
        # (the sidecar's stale-rank series: this job has no sidecar; hours to capacity: its memory
        # does not grow, tests/dashboards/test_live_prometheus.py checks them on a job whose does)
        recorded = [e for e in exprs if any(r in e for r in RECORDED_LABELS)
                    and not any(r in e for r in (REC_JOB_STALE, REC_RANK_HOURS, REC_JOB_HOURS))]
        assert recorded, name
        silent = [expr for expr in recorded if not _api(central, expr)]
        assert not silent, (name, silent)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def _substitute(expr: str) -> str:
    values = {"$namespace": NAMESPACE, "$job": JOB, "$pod": ".*", "$rank": ".*", "$module": ".*",
              "$baseline": "1s", "$__rate_interval": "1m", "$__range": "1m"}
    for var in sorted(values, key=len, reverse=True):
        expr = expr.replace(var, values[var])
    return expr
