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
device and every CUDA allocator statistic, whose step-end bytes grow ``GPU_GROWTH`` bytes a second
(each scrape sees the report a rank stepping at that moment would have exported). That proves those
queries' label matching and arithmetic on real Prometheus, not the tracker's CUDA numbers; the
hours to device capacity are checked against (capacity - step-end bytes now) / growth / 3600.
Prometheus loads the shipped rules as ``fsdp-mem-otel rules`` writes them, with the forecast window
shortened to ``FORECAST_WINDOW`` (1h by default) so that this short run has a forecast.

The leak targets (``Dashboard.leak_only``, test_dashboards.EXPECTED_LEAK_ONLY) must be empty for the
healthy run above and answer for a second real 2-rank run, trained at the same time, that leaks as
``demo --leak`` does (each step's loss kept with its graph): its growth per category and the modules
holding bytes at the step end, equal to what the ranks' last reports say.
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.fleet import alerts
from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.fleet import dashboards as dash
from fsdp_mem_otel.identity import Identity
from tests.dashboards import live_workers
from tests.dashboards.test_dashboards import (
    EXPECTED_CUDA_ONLY,
    EXPECTED_GROWTH_ONLY,
    EXPECTED_LEAK_ONLY,
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
#: the synthetic CUDA job's step-end bytes (activations) grow this many bytes a second; its step peak stays
GPU_GROWTH = 8.0 * 2**20
#: the rules' forecast window for this run (needs two scrapes in each half)
FORECAST_WINDOW = "10s"
#: steps of the leaking run (the tracker calls a category growing from its 10th step end on)
LEAK_STEPS = 30


def _gpu_report(rank: int, grown: int) -> Any:
    report = small_report()
    report.rank = report.local_rank = rank
    report.allocator = {"cuda:0": dict(GPU_ALLOCATOR), "cpu": {"resident_bytes": 2.0**30}}
    for cat_ in ("activation", "total"):
        report.current["cuda:0"][cat_] += grown
    return report


def _gpu_exporters(base_port: int, t0: float) -> list[PrometheusExporter]:
    """The synthetic CUDA job: 2 ranks, each a real exporter serving a report with a cuda:0 device whose
    step-end bytes grow GPU_GROWTH bytes a second from ``t0``: every scrape exports the report of that
    moment first, as a rank that steps continuously would have."""
    exporters = []
    for r in (0, 1):
        ident = Identity(GPU_JOB, r, r, 2, "h", pod=f"{GPU_JOB}-{r}", namespace=GPU_NAMESPACE)
        exp = PrometheusExporter(ident, port=base_port + r, addr="127.0.0.1")
        assert exp.port == base_port + r
        collector, collect = exp.collector, exp.collector.collect

        def growing(rank: int = r, collector: Any = collector, collect: Any = collect) -> Any:
            collector.update(_gpu_report(rank, round(GPU_GROWTH * (time.time() - t0))))
            return collect()

        collector.collect = growing  # type: ignore[method-assign]
        exp.export(_gpu_report(r, 0))
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
    leak_base = free_ports(2)
    ports = {rank_base, rank_base + 1, sidecar_port, prom_port, gpu_base, gpu_base + 1, leak_base, leak_base + 1}
    assert len(ports) == 8
    ranks = [f"127.0.0.1:{p}" for p in (rank_base, rank_base + 1, gpu_base, gpu_base + 1)]
    # the shipped rules (drill-down panels read the job x module series they record), as the rules
    # command writes them, with a forecast window this run outlasts
    rules = tmp / alerts.RULES_FILE
    rules.write_text(alerts.to_yaml({"groups": alerts.rule_groups(alerts.RuleConfig(forecast_window=FORECAST_WINDOW))}))
    config = {
        "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": SCRAPE},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "fsdp-ranks", "static_configs": [{"targets": ranks}]},
            {"job_name": "fsdp-sidecar", "static_configs": [{"targets": [f"127.0.0.1:{sidecar_port}"]}]},
            {"job_name": "fsdp-leak",
             "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in (leak_base, leak_base + 1)]}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    with running_prometheus(tmp / "prometheus.log", prom_port, f"--config.file={tmp / 'prometheus.yml'}",
                            f"--storage.tsdb.path={tmp / 'data'}") as base:
        gpu: list[PrometheusExporter] = []
        try:
            gpu_t0 = time.time()
            gpu = _gpu_exporters(gpu_base, gpu_t0)
            with ThreadPoolExecutor(1) as pool:  # the leaking run trains beside the healthy one
                leaking = pool.submit(run_ranks, live_workers.train_for_prometheus, leak_base, "", 0, LEAK_STEPS,
                                      STEP_SLEEP, SETTLE, live_workers.LEAK_JOB, live_workers.LEAK_NAMESPACE, True,
                                      timeout=180)
                ranks = run_ranks(live_workers.train_for_prometheus, rank_base, str(tmp / "sidecar"), sidecar_port,
                                  STEPS, STEP_SLEEP, SETTLE, timeout=180)
                leak = leaking.result()
            yield {"base": base, "ranks": ranks, "leak": leak, "gpu_t0": gpu_t0}
        finally:
            for exp in gpu:
                exp.shutdown()


def _values(live: dict[str, Any], gpu: bool = False, leak: bool = False) -> dict[str, list[str]]:
    ranks = live["leak"] if leak else live["ranks"]
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


def dashboard_answers(base: str, values: dict[str, list[str]], start: float, end: float,
                      only: set[tuple[str, str, str]] | None = None) -> Iterator[tuple[tuple[str, str, str], str, Any]]:
    """(dashboard uid, panel title, refId), query, Prometheus' data for every panel target (or those
    in ``only``): range queries over start..end, instant queries (tables, stats) at ``end``."""
    for d in dash.build_dashboards():
        for panel, t in targets(d.json):
            key = (d.uid, panel["title"], t["refId"])
            if only is not None and key not in only:
                continue
            expr = substitute(t["expr"], d.json, values)
            if t.get("instant"):
                data = _api(base, "/api/v1/query", {"query": expr, "time": end})
            else:
                data = _api(base, "/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": 1})
            yield key, expr, data


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
    up = _api(live["base"], "/api/v1/query", {"query": 'up{job=~"fsdp-ranks|fsdp-sidecar"}', "time": t_end})["result"]
    assert {(s["metric"]["job"], s["value"][1]) for s in up} == {("fsdp-ranks", "1"), ("fsdp-sidecar", "1")}
    assert len(up) == 5
    leak = live["leak"]
    assert {r["job"] for r in leak} == {live_workers.LEAK_JOB} and all(r["errors_total"] == 0 for r in leak)
    leak_end = min(r["t_end"] for r in leak)
    up = _api(live["base"], "/api/v1/query", {"query": 'up{job="fsdp-leak"}', "time": leak_end})["result"]
    assert [s["value"][1] for s in up] == ["1", "1"]
    # the healthy run reports no leak; the leaking one its growth and the modules holding it
    assert all(not r["leak_growing"] and not r["leak_held"] for r in live["ranks"])
    assert all(r["leak_growing"] and r["leak_held"] for r in leak)
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
    for key, expr, data in dashboard_answers(live["base"], values, start, end):
        results[key] = data
        if _has_finite(data):
            answered.add(key)
        else:
            empty.add(key)
            if key not in EXPECTED_CUDA_ONLY | EXPECTED_LEAK_ONLY:
                failures.append(f"{' / '.join(key)}: no data\n  {expr}")
    assert not failures, "\n".join(failures)
    # CPU only and healthy: every CUDA-only and every leak target stays empty
    assert empty == EXPECTED_CUDA_ONLY | EXPECTED_LEAK_ONLY, (
        f"answered on a healthy CPU run: {(EXPECTED_CUDA_ONLY | EXPECTED_LEAK_ONLY) - empty}")
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
    for key, expr, data in dashboard_answers(live["base"], values, start, end, EXPECTED_CUDA_ONLY):
        checked.add(key)
        if not _has_finite(data):
            failures.append(f"{' / '.join(key)}: no data\n  {expr}")
    assert not failures, "\n".join(failures)
    assert checked == EXPECTED_CUDA_ONLY
    # with a device capacity, the headroom table shows headroom, not the host fallback
    d = next(x for x in dash.build_dashboards() if x.uid == "fsdp-mem-fleet")
    expr = next(t["expr"] for p, t in targets(d.json) if p["title"].startswith("Headroom"))
    got = _api(live["base"], "/api/v1/query", {"query": substitute(expr, d.json, values), "time": end})["result"]
    # (from what runs out: the allocator's reserved peak of the step, above the tracked 8960)
    assert {(s["metric"]["job_name"], s["metric"]["measure"], float(s["value"][1])) for s in got} == {
        (GPU_JOB, "headroom to device capacity (lowest rank)",
         GPU_ALLOCATOR["device_total_bytes"] - max(8960, GPU_ALLOCATOR["reserved_peak_bytes"]))}
    # hours to device capacity: (capacity - step-end bytes at the rule's evaluation) / growth / 3600
    capacity = GPU_ALLOCATOR["device_total_bytes"]
    for d in dash.build_dashboards():
        for panel, t in targets(d.json):
            if (d.uid, panel["title"], t["refId"]) not in EXPECTED_GROWTH_ONLY:
                continue
            got = _api(live["base"], "/api/v1/query", {"query": substitute(t["expr"], d.json, values), "time": end})
            recorded = alerts.REC_JOB_HOURS if d.uid == "fsdp-mem-fleet" else alerts.REC_RANK_HOURS
            when = _api(live["base"], "/api/v1/query",
                        {"query": f'timestamp({recorded}{{job_name="{GPU_JOB}"}})', "time": end})["result"]
            assert len(got["result"]) == len(when) == (1 if recorded == alerts.REC_JOB_HOURS else 2), (got, when)
            for series, stamp in zip(sorted(got["result"], key=str), sorted(when, key=str), strict=True):
                now = 4160 + GPU_GROWTH * (float(stamp["value"][1]) - live["gpu_t0"])
                expected = (capacity - now) / GPU_GROWTH / 3600
                assert float(series["value"][1]) == pytest.approx(expected, rel=0.01), (panel["title"], series)
                assert 2.5 < expected < 3  # 80 GiB at 8 MiB/s: 2.8 h
            if recorded == alerts.REC_RANK_HOURS:
                assert {(s["metric"]["rank"], s["metric"]["device"]) for s in got["result"]} == {
                    ("0", "cuda:0"), ("1", "cuda:0")}


def test_leak_queries_answer_for_a_leaking_job(live: dict[str, Any]) -> None:
    leak = live["leak"]
    start = max(r["t_start"] for r in leak)
    end = min(r["t_end"] for r in leak)
    values = _values(live, leak=True)
    failures = []
    results: dict[tuple[str, str, str], Any] = {}
    for d in dash.build_dashboards():
        for panel, t in targets(d.json):
            key = (d.uid, panel["title"], t["refId"])
            if key not in EXPECTED_LEAK_ONLY:
                continue
            expr = substitute(t["expr"], d.json, values)
            data = _api(live["base"], "/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": 1})
            if not _has_finite(data):
                failures.append(f"{d.uid} / {panel['title']} / {t['refId']}: no data\n  {expr}")
            results[key] = _api(live["base"], "/api/v1/query", {"query": expr, "time": end})["result"]
    assert not failures, "\n".join(failures)
    assert set(results) == EXPECTED_LEAK_ONLY
    # at the end, the values of the ranks' last reports: per category the fastest rank's growth, per
    # module the largest rank's held bytes (each rank exports its cat.LEAK_SERIES largest of each)
    growth: dict[str, float] = {}
    held: dict[str, float] = {}
    for r in leak:
        for c, v in sorted(r["leak_growing"].items(), key=lambda kv: -kv[1])[:cat.LEAK_SERIES]:
            growth[c] = max(growth.get(c, 0.0), float(v))
        for m, n in list(r["leak_held"].items())[:cat.LEAK_SERIES]:
            held[m] = max(held.get(m, 0.0), float(n))
    assert growth and all(v > 0 for v in growth.values()) and "total" in growth
    for title in ("Leak growth per job and category (bytes per step)", "Leak growth per category (fastest rank)"):
        uid = "fsdp-mem-fleet" if "job and" in title else "fsdp-mem-job"
        got = {s["metric"]["category"]: float(s["value"][1]) for s in results[(uid, title, "A")]}
        assert got == pytest.approx(growth), title
    got = {s["metric"]["module"]: float(s["value"][1])
           for s in results[("fsdp-mem-job", "Bytes held at step end per module (largest rank)", "A")]}
    assert got == pytest.approx(held) and set(held) <= set(values["module"])


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
