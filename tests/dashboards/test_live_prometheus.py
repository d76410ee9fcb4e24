"""Every dashboard query answered by a real Prometheus scraping a real 2-rank FSDP2 training.

A Prometheus server (Debian's ``prometheus``, 1 s scrape interval) scrapes both ranks' ``/metrics``
and the sidecar server over their shared directory, while the ranks train for ~15 s. Then every
panel target of every dashboard, with the Grafana variables set to values that exist (the job, its
namespace and pods, both ranks, every module), runs against Prometheus' HTTP API: range queries
over the training window for time-series panels, instant queries at its end for tables and stats.
Each must return at least one finite value, except the targets the dashboards mark CUDA-only
(``Dashboard.cuda_only``, listed in test_dashboards.EXPECTED_CUDA_ONLY), which must return nothing
on this CPU-only run. The variable queries (``label_values``) must find the values used.

No GPU here, so the CUDA-only targets are checked against a second, synthetic job scraped by the
same Prometheus: two real ``PrometheusExporter`` endpoints serving a StepReport with a ``cuda:0``
device and every CUDA allocator statistic. That proves those queries' label matching and arithmetic
on real Prometheus, not the tracker's CUDA numbers.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.fleet import dashboards as dash
from fsdp_mem_otel.identity import Identity
from tests.dashboards import live_workers
from tests.dashboards.test_dashboards import (
    EXPECTED_CUDA_ONLY,
    label_values_selector,
    substitute,
    targets,
    variables,
)
from tests.dist import free_ports, run_ranks
from tests.exporters.test_prometheus import small_report
from tests.prometheus_server import running_prometheus

STEPS = 30
STEP_SLEEP = 0.5
SETTLE = 3.0
SCRAPE = "1s"
ROOT = Path(__file__).resolve().parents[2]
#: stands in for the fleet dashboard's $baseline: the earlier window must fall inside the run
BASELINE = "5s"
GPU_JOB, GPU_NAMESPACE = "dash-e2e-gpu", "e2e-gpu"
#: a CUDA device's allocator statistics, as allocator.py reports them
GPU_ALLOCATOR = {
    "allocated_bytes": 5000.0, "reserved_bytes": 8192.0, "active_bytes": 5100.0, "allocated_peak_bytes": 9000.0,
    "reserved_peak_bytes": 12288.0, "active_peak_bytes": 9100.0, "inactive_split_bytes": 512.0,
    "device_total_bytes": 80.0 * 2**30, "num_alloc_retries": 2.0, "num_ooms": 1.0, "fragmentation_ratio": 0.39,
    "untracked_bytes": 840.0, "outside_pytorch_bytes": 600.0 * 2**20,
}


def _gpu_exporters(base_port: int) -> list[PrometheusExporter]:
    """The synthetic CUDA job: 2 ranks, each a real exporter serving a report with a cuda:0 device."""
    exporters = []
    for r in (0, 1):
        ident = Identity(GPU_JOB, r, r, 2, "h", pod=f"{GPU_JOB}-{r}", namespace=GPU_NAMESPACE)
        exp = PrometheusExporter(ident, port=base_port + r, addr="127.0.0.1")
        assert exp.port == base_port + r
        report = small_report()
        report.rank = report.local_rank = r
        report.allocator = {"cuda:0": dict(GPU_ALLOCATOR), "cpu": {"resident_bytes": 2.0**30}}
        exp.export(report)
        exporters.append(exp)
    return exporters


def _api(base: str, path: str, params: dict[str, Any] | list[tuple[str, str]]) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read().decode())
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("dash_live")
    rank_base, sidecar_port, prom_port, gpu_base = free_ports(2), free_ports(1), free_ports(1), free_ports(2)
    assert len({rank_base, rank_base + 1, sidecar_port, prom_port, gpu_base, gpu_base + 1}) == 6
    ranks = [f"127.0.0.1:{p}" for p in (rank_base, rank_base + 1, gpu_base, gpu_base + 1)]
    config = {
        "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": SCRAPE},
        # the shipped recording rules: drill-down panels read the job x module series they record
        "rule_files": [str(ROOT / "deploy" / "prometheus" / "fsdp-mem-otel.rules.yml")],
        "scrape_configs": [
            {"job_name": "fsdp-ranks", "static_configs": [{"targets": ranks}]},
            {"job_name": "fsdp-sidecar", "static_configs": [{"targets": [f"127.0.0.1:{sidecar_port}"]}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    with running_prometheus(tmp / "prometheus.log", prom_port, f"--config.file={tmp / 'prometheus.yml'}",
                            f"--storage.tsdb.path={tmp / 'data'}") as base:
        gpu: list[PrometheusExporter] = []
        try:
            gpu = _gpu_exporters(gpu_base)
            ranks = run_ranks(live_workers.train_for_prometheus, rank_base, str(tmp / "sidecar"), sidecar_port,
                              STEPS, STEP_SLEEP, SETTLE, timeout=180)
            yield {"base": base, "ranks": ranks}
        finally:
            for exp in gpu:
                exp.shutdown()


def _values(live: dict[str, Any], gpu: bool = False) -> dict[str, list[str]]:
    ranks = live["ranks"]
    if gpu:
        return {"datasource": ["prometheus"], "namespace": [GPU_NAMESPACE], "job": [GPU_JOB],
                "pod": [f"{GPU_JOB}-{r}" for r in (0, 1)], "rank": ["0", "1"], "inspect": ["0", "1"],
                "module": ["<root>", "layers.0"],
                "baseline": [BASELINE]}
    return {
        "datasource": ["prometheus"],
        "namespace": [ranks[0]["namespace"]],
        "job": [ranks[0]["job"]],
        "pod": [r["pod"] for r in ranks],
        "rank": ["0", "1"],
        "inspect": ["0", "1"],
        "module": ranks[0]["modules"],
        "baseline": [BASELINE],
    }


def _has_finite(data: dict[str, Any]) -> bool:
    if data["resultType"] == "matrix":
        points = [v for series in data["result"] for _, v in series["values"]]
    elif data["resultType"] == "vector":
        points = [series["value"][1] for series in data["result"]]
    else:  # scalar
        points = [data["result"][1]]
    return any(math.isfinite(float(v)) for v in points)


def test_run_was_scraped(live: dict[str, Any]) -> None:
    ranks = live["ranks"]
    assert [r["port"] for r in ranks] and all(r["errors_total"] == 0 for r in ranks)
    assert {r["job"] for r in ranks} == {live_workers.JOB}
    assert all(r["devices"] == ["cpu"] for r in ranks)  # a CPU-only run: CUDA-only panels stay empty
    t_end = min(r["t_end"] for r in ranks)
    up = _api(live["base"], "/api/v1/query", {"query": "up", "time": t_end})["result"]
    assert {(s["metric"]["job"], s["value"][1]) for s in up} == {("fsdp-ranks", "1"), ("fsdp-sidecar", "1")}
    assert len(up) == 5
    query = f"max by (rank) ({cat.selector(cat.STEPS_TOTAL, job_name=live_workers.JOB)})"
    steps = _api(live["base"], "/api/v1/query", {"query": query, "time": t_end})
    assert sorted((s["metric"]["rank"], s["value"][1]) for s in steps["result"]) == [("0", str(STEPS)),
                                                                                     ("1", str(STEPS))]


def test_every_dashboard_query_returns_data(live: dict[str, Any]) -> None:
    ranks = live["ranks"]
    start = max(r["t_start"] for r in ranks)
    end = min(r["t_end"] for r in ranks)
    assert end - start > 3 * float(BASELINE[:-1]), "the run must outlast the regression baseline's windows"
    values = _values(live)
    empty: set[tuple[str, str, str]] = set()
    answered: set[tuple[str, str, str]] = set()
    failures = []
    results: dict[tuple[str, str, str], Any] = {}
    for d in dash.build_dashboards():
        for panel, t in targets(d.json):
            key = (d.uid, panel["title"], t["refId"])
            expr = substitute(t["expr"], d.json, values)
            if t.get("instant"):
                data = _api(live["base"], "/api/v1/query", {"query": expr, "time": end})
            else:
                data = _api(live["base"], "/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": 1})
            results[key] = data
            if _has_finite(data):
                answered.add(key)
            else:
                empty.add(key)
                if key not in EXPECTED_CUDA_ONLY:
                    failures.append(f"{d.uid} / {panel['title']} / {t['refId']}: no data\n  {expr}")
    assert not failures, "\n".join(failures)
    assert empty == EXPECTED_CUDA_ONLY, f"CUDA-only targets that answered on CPU: {EXPECTED_CUDA_ONLY - empty}"
    assert len(answered) >= 30
    # CPU ranks report no device capacity: the headroom table falls back to host resident bytes
    headroom = results[("fsdp-mem-fleet", "Headroom to device capacity (lowest first)", "A")]["result"]
    assert {(s["metric"]["job_name"], s["metric"]["measure"]) for s in headroom} == {
        (live_workers.JOB, "host resident (no device capacity reported)")}
    assert all(float(s["value"][1]) > 2**20 for s in headroom)
    # the regression table compares with the earlier window: a flat peak is a 0 change
    change = results[("fsdp-mem-fleet", "Step peak change vs earlier window (regressions first)", "A")]["result"]
    assert [float(s["value"][1]) for s in change] == [0.0]


def test_cuda_only_queries_answer_for_a_cuda_job(live: dict[str, Any]) -> None:
    end = min(r["t_end"] for r in live["ranks"])
    start = end - 10
    values = _values(live, gpu=True)
    failures = []
    checked = set()
    for d in dash.build_dashboards():
        for panel, t in targets(d.json):
            key = (d.uid, panel["title"], t["refId"])
            if key not in EXPECTED_CUDA_ONLY:
                continue
            expr = substitute(t["expr"], d.json, values)
            if t.get("instant"):
                data = _api(live["base"], "/api/v1/query", {"query": expr, "time": end})
            else:
                data = _api(live["base"], "/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": 1})
            checked.add(key)
            if not _has_finite(data):
                failures.append(f"{d.uid} / {panel['title']} / {t['refId']}: no data\n  {expr}")
    assert not failures, "\n".join(failures)
    assert checked == EXPECTED_CUDA_ONLY
    # with a device capacity, the headroom table shows headroom, not the host fallback
    d = next(x for x in dash.build_dashboards() if x.uid == "fsdp-mem-fleet")
    expr = next(t["expr"] for p, t in targets(d.json) if p["title"].startswith("Headroom"))
    got = _api(live["base"], "/api/v1/query", {"query": substitute(expr, d.json, values), "time": end})["result"]
    assert {(s["metric"]["job_name"], s["metric"]["measure"], float(s["value"][1])) for s in got} == {
        (GPU_JOB, "headroom to device capacity (lowest rank)", GPU_ALLOCATOR["device_total_bytes"] - 8960)}


def test_variable_queries_find_the_run(live: dict[str, Any]) -> None:
    ranks = live["ranks"]
    start = max(r["t_start"] for r in ranks)
    end = min(r["t_end"] for r in ranks)
    values = _values(live)
    expected = {k: set(v) for k, v in values.items()}
    for d in dash.build_dashboards():
        for name, v in variables(d.json).items():
            if v["type"] != "query":
                continue
            selector, label = label_values_selector(substitute(v["query"], d.json, values))
            data = _api(live["base"], f"/api/v1/label/{label}/values",
                        [("match[]", selector), ("start", str(start)), ("end", str(end))])
            if name in ("namespace", "job") and "$namespace" not in v["query"]:
                assert expected[name] <= set(data), (d.uid, name, selector, data)  # the CUDA job is there too
            else:
                assert set(data) == expected[name], (d.uid, name, selector, data)
