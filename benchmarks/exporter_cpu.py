"""Exporters' background CPU and output per training step at M=100 FSDP modules.

Records the StepReports of a real FSDP2 run (one process, gloo, M FSDP modules, deep_every=100),
then replays them into each exporter configuration in turn and measures the process CPU time it
adds (all threads: the span builder, the SDK's batch processor, the sidecar and JSONL writers),
per step, plus what it emits: OTLP bytes (the OTLP exporter's own protobuf encoder, one request
per batch), spans, JSONL bytes. Replaying the same reports makes the configurations comparable
in one run; the training itself is not timed here (benchmarks/overhead.py does that).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/exporter_cpu.py --steps 1000 --modules 100
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_mem_otel import FSDPMemoryTracker
from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.demo import make_batch, train_step
from fsdp_mem_otel.exporters.jsonl import JSONLExporter
from fsdp_mem_otel.exporters.otel import OTelSpanExporter
from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import StepReport

WIDTH = 8


class EncodingSpanExporter(SpanExporter):
    """Encodes each batch as the OTLP/HTTP exporter would, then drops it (no network)."""

    def __init__(self) -> None:
        self.spans = 0
        self.bytes = 0

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.spans += len(spans)
        self.bytes += len(encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def record(steps: int, modules: int, deep_every: int) -> list[StepReport]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(modules - 1)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    reports = []
    with FSDPMemoryTracker(model, opt, config=TrackerConfig(deep_every=deep_every), exporters=[]) as tracker:
        for step in range(1, steps + 1):
            train_step(model, opt, make_batch(step, 4, WIDTH, 0))
            reports.append(tracker.step())
            if step % 100 == 0:
                print(f"  recorded {step}/{steps} steps", flush=True)
    return reports


def replay(reports: list[StepReport], make: Callable[[], Any], flush: Callable[[Any], None],
           per_step_flush: bool = False) -> float:
    """Process CPU seconds per step that exporting ``reports`` costs (make and close excluded)."""
    exporter = make()
    start = time.process_time()
    for report in reports:
        exporter.export(report)
        if per_step_flush:
            flush(exporter)
    flush(exporter)
    cpu = time.process_time() - start
    exporter.shutdown()
    return cpu / len(reports)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--modules", type=int, default=100)
    p.add_argument("--deep-every", type=int, default=100)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    print(f"recording {args.steps} steps of {args.modules} FSDP modules, deep_every={args.deep_every}", flush=True)
    reports = record(args.steps, args.modules, args.deep_every)
    dist.destroy_process_group()
    identity = Identity("bench", 0, 0, 1, "host")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, module_spans_every in (("OTLP spans, module spans every step (before)", 1),
                                         ("OTLP spans, defaults (after)", None)):
            sink = EncodingSpanExporter()
            kwargs = {} if module_spans_every is None else {"module_spans_every": module_spans_every}
            # flushed every step: a replay outruns the span builder's queue, which would drop steps
            cpu = replay(reports, lambda s=sink, k=kwargs: OTelSpanExporter(identity, span_exporter=s, **k),
                         lambda e: e.force_flush(timeout=120), per_step_flush=True)
            rows.append((name, cpu, f"{sink.spans / len(reports):.1f} spans, "
                                    f"{sink.bytes / len(reports) / 1024:.1f} KiB OTLP"))
        sidecar = os.path.join(tmp, "sidecar")
        cpu = replay(reports, lambda: PrometheusExporter(identity, http=False, sidecar_dir=sidecar,
                                                         sidecar_interval_seconds=0),
                     lambda e: e.flush(timeout=60), per_step_flush=True)
        size = os.path.getsize(os.path.join(sidecar, "rank-0.prom"))
        rows.append(("Prometheus sidecar file, every step (before)", cpu, f"{size / 1024:.1f} KiB file"))
        # after: at most every 5 s; at one step per second, one render in five steps
        rows.append(("Prometheus sidecar file, every 5 s at 1 step/s (after)", cpu / 5, "one write in 5 steps"))
        path = os.path.join(tmp, "run.jsonl")
        cpu = replay(reports, lambda: JSONLExporter(path), lambda e: e.flush(timeout=120))
        written = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith("run.jsonl"))
        rows.append(("JSONL, defaults", cpu, f"{written / len(reports) / 1024:.2f} KiB per step (with index)"))
    print(f"\n{args.steps} steps, {args.modules} FSDP modules, deep_every={args.deep_every}\n")
    print("| exporter | background CPU per step | output per step |")
    print("|---|---|---|")
    for name, cpu, out in rows:
        print(f"| {name} | {cpu * 1e3:.2f} ms | {out} |")


if __name__ == "__main__":
    main()
