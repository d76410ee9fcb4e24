"""Rank side of the live-Prometheus dashboard test (spawned by tests/dist.py; torch imported inside).

Each rank trains a small FSDP2 model under the tracker with a PrometheusExporter that serves
``/metrics`` per rank and writes a sidecar file; rank 0 also runs the sidecar server over the shared
directory. Steps are spaced out so that a 1 s Prometheus scrape sees many of them, and the ranks keep
serving for a few scrapes after the last step before they stop.

With ``leak=True`` the same training leaks as ``demo --leak`` does (each step's loss kept with its
graph), under its own job name and namespace and without a sidecar: the job the leak panels are
checked against.
"""

from __future__ import annotations

import time
from typing import Any

BLOCKS, WIDTH, BATCH = 3, 32, 8
JOB = "dash-e2e"
NAMESPACE = "e2e"
#: the leaking run's job and namespace (a namespace of its own: the healthy job's variables list it alone)
LEAK_JOB = "dash-e2e-leak"
LEAK_NAMESPACE = "e2e-leak"


def pod_name(rank: int, job: str = JOB) -> str:
    return f"{job}-worker-{rank}"


class _HostAllocatorStats:
    """Fills ``StepReport.allocator["cpu"]["resident_bytes"]`` when the tracker does not (yet).

    The tracker is getting allocator statistics (``allocator.py``); until it reports them, this
    wrapper adds the host's resident bytes, read the same way (psutil), so the dashboards' CPU
    fallbacks are exercised. Once the tracker reports them it changes nothing.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.filled = 0

    def export(self, report: Any) -> None:
        if "resident_bytes" not in report.allocator.get("cpu", {}):
            import psutil

            report.allocator.setdefault("cpu", {})["resident_bytes"] = float(psutil.Process().memory_info().rss)
            self.filled += 1
        self.inner.export(report)

    def __getattr__(self, name: str) -> Any:  # flush, shutdown, ... go to the exporter
        return getattr(self.inner, name)


def train_for_prometheus(base_port: int, sidecar_dir: str, sidecar_port: int, steps: int, step_sleep: float,
                         settle: float, job: str = JOB, namespace: str = NAMESPACE,
                         leak: bool = False) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
    from fsdp_mem_otel.fleet import serve
    from fsdp_mem_otel.identity import Identity
    from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
    from tests.exporters.test_prometheus import small_report

    rank = dist.get_rank()
    env = {**os.environ, "FSDP_MEM_OTEL_JOB": job, "POD_NAME": pod_name(rank, job), "POD_NAMESPACE": namespace}
    identity = Identity.from_env(env)
    model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=2))
    # launched with an estimate (any StepReport will do here): the estimate panel has data
    exporter = PrometheusExporter(identity, base_port=base_port, addr="127.0.0.1", sidecar_dir=sidecar_dir or None,
                                  heartbeat_seconds=1.0, estimate=small_report())
    wrapped = _HostAllocatorStats(exporter)
    server = None
    if rank == 0 and sidecar_dir:
        server = serve.make_server(sidecar_dir, sidecar_port, "127.0.0.1", stale_seconds=60.0)
        server.start()
    tracker = FSDPMemoryTracker(model, opt, exporters=[wrapped])
    dist.barrier()
    t_start = time.time()
    report = None
    kept: list[Any] | None = [] if leak else None  # demo --leak: each loss kept with its graph
    with tracker:
        for step in range(steps):
            train_step(model, opt, make_batch(step, BATCH, WIDTH, rank), on_inputs=tracker.track_inputs,
                       keep_losses=kept)
            report = tracker.step()
            time.sleep(step_sleep)
        t_last_step = time.time()
        time.sleep(settle)  # a few more scrapes of the final state
        dist.barrier()
        t_end = time.time()
        dist.barrier()
        if server is not None:
            server.stop()
    tracker.close()
    assert report is not None
    return {
        "t_start": t_start,
        "t_last_step": t_last_step,
        "t_end": t_end,
        "port": exporter.port,
        "job": identity.job,
        "pod": identity.pod,
        "namespace": identity.namespace,
        "modules": sorted(report.modules),
        "devices": sorted(report.peak),
        "allocator_devices": sorted(report.allocator),
        "filled_resident": wrapped.filled,
        "errors_total": tracker.errors_total,
        # the last report's leak: what the exporter serves once the steps are over
        "leak_growing": dict(report.leak.growing) if report.leak is not None else {},
        "leak_held": dict(report.leak.held) if report.leak is not None else {},
    }
