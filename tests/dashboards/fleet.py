"""A synthetic fleet on a real Prometheus, and what each dashboard query costs there.

Shared by tests/dashboards/test_fleet_prometheus.py (CI: 256 + 128 ranks) and
benchmarks/fleet.py (1,024 ranks). Every rank's series come from the package's own exposition
code: a ``PrometheusExporter`` writes the rank's sidecar file from a StepReport (M modules, a
``cuda:<local_rank>`` device with every allocator statistic, figures that differ by rank), and
``serve.SidecarCollector`` merges the 8 rank files of a pod as the shipped sidecar does. One
loopback HTTP server serves each pod's exposition on its own path; a real Prometheus (Debian's
``prometheus``) scrapes every pod, as the shipped PodMonitor does, and evaluates the shipped
recording rules.

Then every panel target of every dashboard runs with its variables at their widest defaults (All
namespaces, pods, ranks and modules; the fleet's largest job), and :func:`query_costs` records:

- ``series``: the series its selectors read (``count()`` of each selector; a selector used twice
  counts twice), the figure the fleet budget (10,000) is about;
- ``samples`` / ``peak_samples``: Prometheus' own query statistics (``stats=all``) over the
  measured window, at 720 points for range queries;
- ``projected_samples``: samples at the dashboard's default range (3 h) and a 15 s scrape
  interval: per selector, series x points (720 for range queries, 1 for instant ones) x samples
  per point (range / 15 s for range selectors, else 1), to hold against Prometheus' default
  ``query.max-samples`` (50,000,000);
- ``seconds``: the query's latency.
"""

from __future__ import annotations

import http.server
import json
import re
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import promql_parser

from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.fleet import dashboards as dash
from fsdp_mem_otel.fleet.serve import SidecarCollector
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import CATEGORY_KEYS, STATES, LeakReport, ModuleReport, StepReport
from tests.dashboards.test_dashboards import substitute, targets, variables
from tests.dist import free_ports
from tests.prometheus_server import running_prometheus

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "fsdp-mem-otel.rules.yml"
NAMESPACE = "fleet"
RANKS_PER_POD = 8
#: the fleet budget: no dashboard query may read more series than this
SERIES_BUDGET = 10_000
#: Prometheus' default --query.max-samples
MAX_SAMPLES = 50_000_000
#: a dashboard's default range (3 h) at Grafana's 15 s resolution for a 15 s scrape interval
DEFAULT_POINTS = 720
SCRAPE_SECONDS = 15
#: Grafana's built-ins as they stand at the default range, for the projection
PROJECTED_BUILTINS = {"__rate_interval": "60s", "__interval": "15s", "__range": "3h", "__range_s": "10800"}


@dataclass(frozen=True)
class Job:
    name: str
    ranks: int


def rank_report(rank: int, world: int, modules: int) -> StepReport:
    """One rank's step on a CUDA device, with every module's forward and backward states, leaking
    (three categories growing, tensors of the three last modules held at the step end: as many leak
    series as a rank exports)."""
    local = rank % RANKS_PER_POD
    dev = f"cuda:{local}"
    scale = 1 + (rank % 7) / 100  # ranks differ a little, as real ranks do
    bytes_ = {dev: {c: int(2**20 * (i + 1) * scale) for i, c in enumerate(CATEGORY_KEYS)},
              "cpu": {c: 8 * (i + 1) for i, c in enumerate(CATEGORY_KEYS)}}
    keys = ["<root>"] + [f"layers.{i}" for i in range(modules - 1)]
    mods = {k: ModuleReport({s: [bytes_] for s in STATES}, {s: [0.010 * scale, 0.020 * scale] for s in STATES})
            for k in keys}
    allocator = {dev: {"allocated_bytes": 6e9 * scale, "reserved_bytes": 7e9, "active_bytes": 6.1e9,
                       "allocated_peak_bytes": 7e9, "reserved_peak_bytes": 7.5e9, "active_peak_bytes": 7.1e9,
                       "inactive_split_bytes": 1e8, "device_total_bytes": 80 * 2.0**30, "num_alloc_retries": 0.0,
                       "num_ooms": 0.0, "fragmentation_ratio": 0.14, "untracked_bytes": 1e7,
                       "outside_pytorch_bytes": 6e8},
                 "cpu": {"resident_bytes": 2.0**33}}
    leak = LeakReport(growing={"activation": 4096.0 * scale, "inputs": 1024.0, "total": 5120.0 * scale},
                      held={k: int(2**20 * scale) for k in keys[-3:]}, steps=30)
    return StepReport(step=100, rank=rank, world_size=world, mode="light", fsdp_version=2, peak=bytes_,
                      modules=mods, module_order=keys, current=bytes_, allocator=allocator, local_rank=local,
                      duration_seconds=1.0, tracker_overhead_seconds=0.004, timestamp=time.time(), leak=leak)


def render_pods(jobs: list[Job], modules: int, workdir: Path, progress: Any = None) -> dict[str, bytes]:
    """path -> a pod sidecar's exposition, for every pod of every job."""
    pages: dict[str, bytes] = {}
    for job in jobs:
        for pod in range((job.ranks + RANKS_PER_POD - 1) // RANKS_PER_POD):
            pod_name = f"{job.name}-{pod}"
            directory = workdir / pod_name
            for rank in range(pod * RANKS_PER_POD, min(job.ranks, (pod + 1) * RANKS_PER_POD)):
                ident = Identity(job.name, rank, rank % RANKS_PER_POD, job.ranks, "node", pod=pod_name,
                                 namespace=NAMESPACE)
                report = rank_report(rank, job.ranks, modules)
                # launched with an estimate (the drill-down's "Step peak vs estimate" reads it)
                exp = PrometheusExporter(ident, http=False, sidecar_dir=str(directory), sidecar_interval_seconds=0,
                                         estimate=report)
                exp.export(report)
                exp.flush(timeout=60)
                exp.shutdown()
            pages[f"/pods/{pod_name}"] = SidecarCollector(str(directory)).render()
            if progress is not None and (pod + 1) % 16 == 0:
                progress(f"{job.name}: rendered {pod + 1} pods")
    return pages


class _Pages(http.server.BaseHTTPRequestHandler):
    pages: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = self.pages.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        try:
            self.wfile.write(body or b"")
        except (BrokenPipeError, ConnectionResetError):  # Prometheus stopped mid-scrape
            pass

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serving(pages: dict[str, bytes]) -> Iterator[int]:
    """Serve ``pages`` on a loopback port (yielded) until the block ends."""
    handler = type("Pages", (_Pages,), {"pages": pages})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def api(base: str, path: str, params: dict[str, Any] | list[tuple[str, str]], timeout: float = 60) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body = json.loads(resp.read().decode())
    assert body["status"] == "success", body
    return body["data"]


@contextmanager
def prometheus(pages: dict[str, bytes], page_port: int, workdir: Path, interval: str) -> Iterator[str]:
    """A Prometheus scraping every page every ``interval`` with the shipped rules; yields its URL."""
    port = free_ports()
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": "fsdp-sidecar",
            "static_configs": [{"targets": [f"127.0.0.1:{page_port}"],
                                "labels": {"__metrics_path__": path, "instance": path.rsplit("/", 1)[1]}}
                               for path in pages],
        }],
    }
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    with running_prometheus(workdir / "prometheus.log", port, f"--config.file={workdir / 'prometheus.yml'}",
                            f"--storage.tsdb.path={workdir / 'data'}", ready_timeout=60) as base:
        yield base


def wait_for_samples(base: str, pages: int, rounds: int, timeout: float) -> None:
    """Wait until every page was scraped ``rounds`` times and the recording rules ran as often."""
    deadline = time.monotonic() + timeout
    while True:
        up = api(base, "/api/v1/query", {"query": f'count_over_time(up{{job="fsdp-sidecar"}}[1h]) >= {rounds}'})
        rec = api(base, "/api/v1/query",
                  {"query": "count_over_time(namespace_job_name:fsdp_mem_step_peak_bytes:max[1h])"})
        if len(up["result"]) == pages and rec["result"] and min(float(s["value"][1]) for s in rec["result"]) >= rounds:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(up['result'])} of {pages} pages scraped {rounds} times within {timeout} s")
        time.sleep(1)


def widest_values(d: dict[str, Any], job: str, baseline: str) -> dict[str, list[str]]:
    """Every include-All variable at All, the job variable at ``job``, rank pickers at rank 0."""
    out: dict[str, list[str]] = {}
    for name, v in variables(d).items():
        if v.get("includeAll"):
            out[name] = [v.get("allValue", ".*")]
        elif name == "datasource":
            out[name] = ["prometheus"]
        elif name == "job":
            out[name] = [job]
        elif name == "baseline":
            out[name] = [baseline]
        else:  # a single-valued rank picker
            out[name] = ["0"]
    return out


def _selectors(expr: str) -> list[tuple[promql_parser.VectorSelector, float]]:
    """(selector, its range in seconds or 0) for every vector selector of ``expr``."""
    found: list[tuple[promql_parser.VectorSelector, float]] = []
    in_matrix: set[int] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.MatrixSelector):
            rng = node.range.total_seconds() if isinstance(node.range, timedelta) else 0.0
            found.append((node.vector_selector, rng))
            in_matrix.add(id(node.vector_selector))
        elif isinstance(node, promql_parser.VectorSelector) and id(node) not in in_matrix:
            found.append((node, 0.0))
        return True

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return found


_MODIFIERS = re.compile(r"\s+(offset\s+-?\S+|@\s+\S+)")


@dataclass(frozen=True)
class QueryCost:
    """What one dashboard target costs Prometheus (see the module docstring)."""

    dashboard: str
    panel: str
    ref: str
    expr: str
    series: int
    samples: int
    peak_samples: int
    projected_samples: int
    seconds: float
    answered: bool


def _with_builtins(expr: str, d: dict[str, Any], values: dict[str, list[str]], builtins: dict[str, str]) -> str:
    from tests.dashboards import test_dashboards

    saved = dict(test_dashboards.BUILTINS)
    test_dashboards.BUILTINS.update(builtins)
    try:
        return substitute(expr, d, values)
    finally:
        test_dashboards.BUILTINS.clear()
        test_dashboards.BUILTINS.update(saved)


def query_costs(base: str, job: str, start: float, end: float, scrape_seconds: float) -> list[QueryCost]:
    """Run every dashboard target over [start, end] and measure it (module docstring)."""
    window = end - start
    rate = max(1, int(4 * scrape_seconds))  # Grafana's $__rate_interval: 4 scrape intervals
    measured = {"__rate_interval": f"{rate}s", "__interval": f"{max(1, int(scrape_seconds))}s",
                "__range": f"{int(window)}s", "__range_s": str(int(window))}
    counted: dict[str, int] = {}
    costs = []
    for d in dash.build_dashboards():
        values = widest_values(d.json, job, baseline=f"{max(1, int(window // 3))}s")
        for panel, t in targets(d.json):
            instant = bool(t.get("instant"))
            projected = 0
            series = 0
            for sel, rng in _selectors(_with_builtins(t["expr"], d.json, values, PROJECTED_BUILTINS)):
                text = _MODIFIERS.sub("", str(sel))
                if text not in counted:
                    got = api(base, "/api/v1/query", {"query": f"count({text})", "time": end})["result"]
                    counted[text] = int(float(got[0]["value"][1])) if got else 0
                series += counted[text]
                points = 1 if instant else DEFAULT_POINTS
                projected += counted[text] * points * max(1, int(rng // SCRAPE_SECONDS))
            expr = _with_builtins(t["expr"], d.json, values, measured)
            t0 = time.perf_counter()
            if instant:
                data = api(base, "/api/v1/query", {"query": expr, "time": end, "stats": "all"})
            else:
                step = max(window / DEFAULT_POINTS, 0.001)
                data = api(base, "/api/v1/query_range",
                           {"query": expr, "start": start, "end": end, "step": f"{step:.3f}", "stats": "all"})
            seconds = time.perf_counter() - t0
            stats = data.get("stats", {}).get("samples", {})
            costs.append(QueryCost(d.uid, panel["title"], t["refId"], expr, series,
                                   int(stats.get("totalQueryableSamples", 0)), int(stats.get("peakSamples", 0)),
                                   projected, seconds, bool(data["result"])))
    return costs


@contextmanager
def fleet(jobs: list[Job], modules: int, interval: str = "2s", rounds: int = 3, progress: Any = None,
          workdir: Path | None = None) -> Iterator[tuple[str, float, float]]:
    """Render, serve and scrape the fleet; yields (Prometheus URL, window start, window end)."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.monotonic()
        pages = render_pods(jobs, modules, tmp / "pods", progress)
        if progress is not None:
            size = sum(map(len, pages.values())) / 2**20
            progress(f"rendered {len(pages)} pods ({size:.0f} MB of exposition) in {time.monotonic() - t0:.0f} s")
        with serving(pages) as port, prometheus(pages, port, tmp, interval) as base:
            start = time.time()
            seconds = float(interval.rstrip("s"))
            wait_for_samples(base, len(pages), rounds, timeout=60 + 20 * rounds * seconds)
            end = time.time()
            if progress is not None:
                progress(f"scraped {len(pages)} pods {rounds}+ times, rules evaluated")
            yield base, start, end


def series_total(base: str) -> int:
    got = api(base, "/api/v1/query", {"query": 'count({__name__=~".+"})'})["result"]
    return int(float(got[0]["value"][1])) if got else 0
