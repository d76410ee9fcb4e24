"""Step time while the tracker's exporters are failing, side by side with the healthy case.

Run (2 ranks, gloo, CPU):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/faults.py [--rounds 5] [--steps 10]

Every variant runs the tracker (light mode) with all exporters on: Prometheus per rank, sidecar
file, JSON lines and OpenTelemetry spans (spans_every=1, the heaviest setting). "healthy" has
them all working; each other variant breaks one thing: an extra exporter that raises on every
step, the OTLP endpoint down (nothing listening) or hanging (accepts, never answers), the
sidecar directory and the JSONL file unwritable (their parent is a regular file), the metrics
port already taken. Variants are interleaved round by round; prints each one's median step time
relative to healthy. Target: within 5%.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist

from fsdp_mem_otel.exporters.jsonl import JSONLExporter
from fsdp_mem_otel.exporters.otel import OTelSpanExporter
from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.tools.demo import WrapOptions, build, init_distributed, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

VARIANTS = ("healthy", "exporter_raises", "otlp_down", "otlp_hanging", "sidecar_unwritable",
            "jsonl_unwritable", "port_taken")


class _OkCollector(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


class _Raising:
    def export(self, report: object) -> None:
        raise RuntimeError("exporter fault (benchmark)")

    def shutdown(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Faults:
    """Endpoints and paths, healthy and broken, on loopback and in a temp dir."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="fsdp-mem-otel-faults-")
        self.blocker = os.path.join(self.tmp, "not-a-dir")
        open(self.blocker, "w").close()
        self.ok = ThreadingHTTPServer(("127.0.0.1", 0), _OkCollector)
        threading.Thread(target=self.ok.serve_forever, daemon=True).start()
        self.hang = socket.socket()
        self.hang.bind(("127.0.0.1", 0))
        self.hang.listen(1024)  # accepts into the backlog, never answers
        self.down_port = _free_port()
        self.taken = socket.socket()
        self.taken.bind(("127.0.0.1", 0))
        self.taken.listen(1)

    def exporters(self, variant: str, rank: int) -> list[Any]:
        otlp = {
            "otlp_down": f"http://127.0.0.1:{self.down_port}",
            "otlp_hanging": f"http://127.0.0.1:{self.hang.getsockname()[1]}",
        }.get(variant, f"http://127.0.0.1:{self.ok.server_address[1]}")
        sidecar = os.path.join(self.blocker if variant == "sidecar_unwritable" else self.tmp, f"sidecar-{variant}")
        jsonl = os.path.join(self.blocker if variant == "jsonl_unwritable" else self.tmp, f"{variant}-{rank}.jsonl")
        port = int(self.taken.getsockname()[1]) if variant == "port_taken" else 0
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp
        try:
            spans = OTelSpanExporter(export_timeout=2.0)
        finally:
            del os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
        out: list[Any] = [
            PrometheusExporter(port=port, addr="127.0.0.1", sidecar_dir=sidecar), JSONLExporter(jsonl), spans,
        ]
        if variant == "exporter_raises":
            out.append(_Raising())
        return out


def _time(tracker: FSDPMemoryTracker, model: torch.nn.Module, opt: torch.optim.Optimizer,
          xs: list[torch.Tensor]) -> list[float]:
    times = []
    for x in xs:
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, opt, x)
        tracker.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round (default 10)")
    p.add_argument("--blocks", type=int, default=16, help="blocks of the dispatch-bound model (default 16)")
    args = p.parse_args(argv)
    rank, world = init_distributed()
    model, opt = build(args.blocks, 64, WrapOptions(fsdp=2))
    xs = [make_batch(i, 8, 64, rank) for i in range(args.steps)]
    faults = Faults()
    trackers = {v: FSDPMemoryTracker(model, opt, exporters=faults.exporters(v, rank)) for v in VARIANTS}
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:  # warm-up, and every fault hit at least once
        with trackers[v]:
            _time(trackers[v], model, opt, xs[:2])
    for r in range(args.rounds):
        for v in VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS)):
            with trackers[v]:
                samples[v].append(statistics.median(_time(trackers[v], model, opt, xs)))
        if rank == 0:
            print(f"  round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    errors = {v: sum(getattr(e, "errors_total", 0) for e in t.exporters) + t.errors_total
              for v, t in trackers.items()}
    for t in trackers.values():
        t.close()
    base = statistics.median(samples["healthy"])
    if rank == 0:
        print(f"world_size={world} blocks={args.blocks} rounds={args.rounds} steps={args.steps}")
        print(f"{'variant':<20} {'step ms':>8} {'vs healthy':>11} {'errors counted':>15}")
        worst = 0.0
        for v in VARIANTS:
            ratio = statistics.median(samples[v]) / base
            worst = max(worst, ratio)
            print(f"{v:<20} {statistics.median(samples[v]) * 1e3:>8.2f} {ratio:>10.3f}x {errors[v]:>15}")
        print("target (every fault within 5% of healthy):", "met" if worst <= 1.05 else f"missed, worst {worst:.3f}x")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
