"""On a GPU: the dashboards' CUDA-only queries answered by a real Prometheus scraping a real CUDA run.

One process trains an FSDP2 model on GPU 0 (a 1-rank NCCL group) under the tracker, its
``PrometheusExporter`` serving ``/metrics``; a Prometheus server (Debian's ``prometheus``, 1 s scrape,
the shipped rules with a short forecast window) scrapes it. The run keeps each step's loss with its
graph, as ``demo --leak`` does, so its step-end bytes grow and the hours-to-capacity panels have a
forecast. Then every target the dashboards mark CUDA-only (test_dashboards.EXPECTED_CUDA_ONLY), with
the variables set to this job, must return a finite value, and what Prometheus holds for the
allocator's bytes is what the tracker's last report said. The CPU-only runs of
test_live_prometheus.py check these targets against a synthetic CUDA job; this one is the real
allocator. Skipped without a GPU (CI has none).
"""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the Prometheus server"),
]

JOB, NAMESPACE, POD = "cuda-e2e", "e2e-cuda", "cuda-e2e-0"
STEPS, STEP_SLEEP, SETTLE = 30, 0.5, 3.0


def _train(port: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
    from fsdp_mem_otel.identity import Identity
    from fsdp_mem_otel.tools.demo import BlockModel, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    torch.manual_seed(0)
    model = BlockModel(4, 1024).cuda()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    identity = Identity(JOB, 0, 0, 1, "gpu-host", pod=POD, namespace=NAMESPACE)
    exporter = PrometheusExporter(identity, port=port, addr="127.0.0.1")
    tracker = FSDPMemoryTracker(model, opt, exporters=[exporter])
    kept: list[Any] = []  # each step's loss with its graph: step-end bytes grow
    t_start = time.time()
    with tracker:
        for _ in range(STEPS):
            train_step(model, opt, torch.randn(256, 1024, device="cuda"), keep_losses=kept)
            report = tracker.step()
            time.sleep(STEP_SLEEP)
        time.sleep(SETTLE)  # a few more scrapes of the final state
        t_end = time.time()
    tracker.close()
    return {"t_start": t_start, "t_end": t_end, "allocator": report.allocator["cuda:0"],
            "errors": tracker.errors_total, "modules": sorted(report.modules)}


@pytest.fixture(scope="module")
def scraped(one_rank_nccl: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from fsdp_mem_otel.fleet import alerts
    from tests.dashboards.test_live_prometheus import FORECAST_WINDOW, SCRAPE
    from tests.dist import free_ports
    from tests.prometheus_server import running_prometheus

    tmp = tmp_path_factory.mktemp("cuda_prom")
    rank_port, prom_port = free_ports(1), free_ports(1)
    rules = tmp / alerts.RULES_FILE
    rules.write_text(alerts.to_yaml({"groups": alerts.rule_groups(alerts.RuleConfig(forecast_window=FORECAST_WINDOW))}))
    config = {
        "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": SCRAPE},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "fsdp-ranks", "static_configs": [{"targets": [f"127.0.0.1:{rank_port}"]}]}],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config))
    with running_prometheus(tmp / "prometheus.log", prom_port, f"--config.file={tmp / 'prometheus.yml'}",
                            f"--storage.tsdb.path={tmp / 'data'}") as base:
        run = _train(rank_port)
        yield {"base": base, **run}


def _values(run: dict[str, Any]) -> dict[str, list[str]]:
    return {"datasource": ["prometheus"], "namespace": [NAMESPACE], "job": [JOB], "pod": [POD], "rank": ["0"],
            "inspect": ["0"], "module": run["modules"], "baseline": ["5s"]}


def test_cuda_only_queries_answer_for_a_real_cuda_run(scraped: dict[str, Any]) -> None:
    from tests.dashboards.test_dashboards import EXPECTED_CUDA_ONLY
    from tests.dashboards.test_live_prometheus import _has_finite, dashboard_answers

    assert scraped["errors"] == 0
    end = scraped["t_end"]
    failures, answers = [], {}
    for key, expr, data in dashboard_answers(scraped["base"], _values(scraped), max(scraped["t_start"], end - 10),
                                             end, EXPECTED_CUDA_ONLY):
        answers[" / ".join(key)] = data["result"][:2]
        if not _has_finite(data):
            failures.append(f"{' / '.join(key)}: no data\n  {expr}")
    print("GPU-RESULT", json.dumps({"test": "cuda_prometheus", "answers": answers}, default=str)[:20000])
    assert not failures, "\n".join(failures)
    assert len(answers) == len(EXPECTED_CUDA_ONLY)


def test_prometheus_holds_what_the_allocator_said(scraped: dict[str, Any]) -> None:
    from fsdp_mem_otel.fleet import catalog as cat
    from tests.dashboards.test_live_prometheus import _api

    last = scraped["allocator"]
    for m in (cat.ALLOCATED_BYTES, cat.RESERVED_BYTES, cat.DEVICE_TOTAL_BYTES, cat.OUTSIDE_PYTORCH_BYTES,
              cat.UNTRACKED_BYTES):
        got = _api(scraped["base"], "/api/v1/query",
                   {"query": cat.selector(m, job_name=JOB, device="cuda:0"), "time": scraped["t_end"]})["result"]
        assert [float(s["value"][1]) for s in got] == [float(last[m.source])], m.name
    assert last["device_total_bytes"] == torch.cuda.mem_get_info()[1]
    assert last["allocated_bytes"] > 0 and last["outside_pytorch_bytes"] > 0
