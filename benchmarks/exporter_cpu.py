"""Exporters' background CPU and output per training step at M=100 FSDP modules.

Records the StepReports of a real FSDP2 run (one process, gloo, M FSDP modules, deep_every=100),
then replays them into each exporter configuration in turn, and into all three at once, and
measures the process CPU time they add (all threads: the span builder, the SDK's batch
processor, the sidecar and JSONL writers), per step, plus what they emit: OTLP bytes (the OTLP
exporter's own protobuf encoder, one request per batch), spans, JSONL bytes. Replaying the same
reports makes the configurations comparable in one run; the training itself is not timed here
(benchmarks/overhead.py does that).

A replay runs far faster than training, so it models a step rate: every ``--flush-every`` steps
(default 5: one step per second) the span and JSONL exporters are flushed, which is what their
own clocks do once per 5 s in a job: the span processor sends its batch
(``OTEL_BSP_SCHEDULE_DELAY``, 5 s), the JSONL writer catches up (it writes every step); the
sidecar is flushed every ``--sidecar-every`` steps (default 15: its ``sidecar_interval_seconds``,
15 s, at one step per second; its own interval is set to an hour here so that only the flush
renders). ``--flush-every 1 --sidecar-every 3`` is one step per 5 s. Nothing is dropped: the
script fails if an exporter dropped a step.

Every replay gets the reports as the tracker hands them over: a module's snapshots are the
recorder's counters, its positions in the step's log, until an exporter first reads
``snapshots``, which then builds their dicts (``schema.CountedModuleReport``; about 1,000 dicts
per step at 100 modules) and keeps them on the
report. Replaying the same report objects again would find them built and leave that cost out,
so before each replay they are set back (``--reuse-snapshots`` keeps them, as this script did
before: each configuration's first round then paid for the dicts and the others did not).

``--paced N`` then also runs all three at once on their own clocks (their defaults: the sidecar's
interval, the span processor's delay), exporting N light steps one per ``--period`` seconds after
10 uncounted ones: the CPU per step of the steady state, with what the replay cannot see, the
work the exporters' threads do as time passes (timed waits, heartbeats), and each step's work
done alone on a thread just woken, as in a job.

``--reports FILE`` keeps the recorded reports (pickle) and replays them again on the next run, so
two versions of the package can be measured on the very same reports: run the script once per
version, each with its own ``PYTHONPATH``, with the same FILE.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/exporter_cpu.py --steps 1000 --modules 100
"""

from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

import fsdp_mem_otel
from fsdp_mem_otel.exporters.jsonl import JSONLExporter
from fsdp_mem_otel.exporters.otel import OTelSpanExporter
from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import CountedModuleReport, StepReport

WIDTH = 8
#: the sidecar's interval in the replay: only the flushes render (see the module docstring)
NO_INTERVAL_WRITES = 3600.0
#: --paced: steps exported before the CPU time is counted
PACED_WARMUP = 10


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
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from fsdp_mem_otel import FSDPMemoryTracker
    from fsdp_mem_otel.config import TrackerConfig
    from fsdp_mem_otel.tools.demo import make_batch, train_step

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
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
    dist.destroy_process_group()
    return reports


def as_handed_over(reports: list[StepReport]) -> None:
    """Drop the snapshot dicts an earlier replay built, and the per-state lists it sorted out of
    the step's log: each report as the tracker hands it over."""
    for report in reports:
        for mod in report.modules.values():
            if isinstance(mod, CountedModuleReport):
                mod._snapshots = None
                if getattr(mod, "_log", None) is not None:  # the tracker's form (not older versions')
                    mod._counters = mod._times = None


def paced(reports: list[StepReport], exporters: list[Any], period: float, warmup: int) -> float:
    """Process CPU seconds per step, exporting one report every ``period`` seconds; the first
    ``warmup`` reports are not counted (a JSONL file's first line carries the module snapshots,
    the sidecar's first render makes every series' text)."""
    start, t0 = time.process_time(), time.monotonic()
    for i, report in enumerate(reports, 1):
        if i == warmup + 1:
            start = time.process_time()
        for e in exporters:
            e.export(report)
        time.sleep(max(0.0, t0 + i * period - time.monotonic()))
    cpu = time.process_time() - start
    for e in exporters:
        e.shutdown()
    return cpu / (len(reports) - warmup)


def flush_all(exporters: list[Any]) -> None:
    for e in exporters:
        ok = e.force_flush(timeout=300) if isinstance(e, OTelSpanExporter) else e.flush(timeout=300)
        if not ok:
            raise RuntimeError(f"{type(e).__name__} did not flush")


def replay(reports: list[StepReport], exporters: list[Any], flush_every: int, sidecar_every: int) -> float:
    """Process CPU seconds per step that exporting ``reports`` costs (construction and close excluded)."""
    start = time.process_time()
    for i, report in enumerate(reports, 1):
        for e in exporters:
            e.export(report)
            if i % (sidecar_every if isinstance(e, PrometheusExporter) else flush_every) == 0:
                flush_all([e])
    flush_all(exporters)
    cpu = time.process_time() - start
    for e in exporters:
        e.shutdown()
    for e in exporters:  # every step reached its output: nothing was dropped on the way
        if isinstance(e, JSONLExporter):
            assert e.dropped_total == 0 and e.lines_total == len(reports), (e.dropped_total, e.lines_total)
        if isinstance(e, OTelSpanExporter):
            wanted = sum(1 for r in reports if e.wants(r))
            assert e.steps_exported == wanted and e.errors_total == 0, (e.steps_exported, wanted, e.errors_total)
        assert e.errors_total == 0, (type(e).__name__, e.errors_total)
    return cpu / len(reports)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--modules", type=int, default=100)
    p.add_argument("--deep-every", type=int, default=100)
    p.add_argument("--flush-every", type=int, default=5,
                   help="steps between flushes (default 5: one step per second, see the module docstring)")
    p.add_argument("--sidecar-every", type=int, default=15,
                   help="steps between sidecar renders (default 15: its default interval at one step per second)")
    p.add_argument("--paced", type=int, default=0, metavar="N",
                   help="also export N light steps to all three at once, one per --period seconds, on "
                        "their own clocks (see the module docstring)")
    p.add_argument("--period", type=float, default=1.0, help="seconds between steps with --paced (default 1)")
    p.add_argument("--reuse-snapshots", action="store_true",
                   help="keep the snapshot dicts built by earlier replays (see the module docstring)")
    p.add_argument("--reports", default=None, help="pickle of the recorded reports: replayed if it exists, "
                                                   "else written after recording")
    p.add_argument("--rounds", type=int, default=1, help="replay each configuration this many times, "
                                                         "interleaved; the median is shown (0: no replay, "
                                                         "--paced only)")
    args = p.parse_args()
    print(f"fsdp_mem_otel from {os.path.dirname(fsdp_mem_otel.__file__)}", flush=True)
    if args.reports and os.path.exists(args.reports):
        with open(args.reports, "rb") as f:
            reports = pickle.load(f)
        print(f"replaying {len(reports)} recorded steps from {args.reports}", flush=True)
    else:
        print(f"recording {args.steps} steps of {args.modules} FSDP modules, deep_every={args.deep_every}",
              flush=True)
        reports = record(args.steps, args.modules, args.deep_every)
        if args.reports:
            with open(args.reports, "wb") as sink_file:
                pickle.dump(reports, sink_file)
    modules = len(reports[-1].modules)
    deep = sum(1 for r in reports if r.mode == "deep")
    identity = Identity("bench", 0, 0, 1, "host")
    names = ("OTLP spans", "Prometheus sidecar file", "JSONL", "all three at once")
    cpu: dict[str, list[float]] = {n: [] for n in names}
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            for name in order:
                d = os.path.join(tmp, f"{rnd}-{names.index(name)}")
                sink = EncodingSpanExporter()
                exporters: list[Any] = []
                if name in ("OTLP spans", "all three at once"):
                    exporters.append(OTelSpanExporter(identity, span_exporter=sink))
                if name in ("Prometheus sidecar file", "all three at once"):
                    exporters.append(PrometheusExporter(identity, http=False, sidecar_dir=os.path.join(d, "sidecar"),
                                                        sidecar_interval_seconds=NO_INTERVAL_WRITES))
                if name in ("JSONL", "all three at once"):
                    exporters.append(JSONLExporter(os.path.join(d, "run.jsonl")))
                if not args.reuse_snapshots:
                    as_handed_over(reports)
                cpu[name].append(replay(reports, exporters, args.flush_every, args.sidecar_every))
                n = len(reports)
                if name == "OTLP spans":
                    out[name] = f"{sink.spans / n:.1f} spans, {sink.bytes / n / 1024:.1f} KiB OTLP"
                elif name == "Prometheus sidecar file":
                    size = os.path.getsize(os.path.join(d, "sidecar", "rank-0.prom"))
                    out[name] = f"{size / 1024:.1f} KiB file, written every {args.sidecar_every} steps"
                elif name == "JSONL":
                    written = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                                  if f.startswith("run.jsonl"))
                    out[name] = f"{written / n / 1024:.2f} KiB per step (with index)"
                else:
                    out[name] = "the three above, in one process"
    if args.rounds:
        built = "snapshot dicts kept between replays" if args.reuse_snapshots else "reports as handed over"
        print(f"\n{len(reports)} steps ({deep} deep), {modules} FSDP modules, flushed every {args.flush_every} "
              f"steps (the sidecar every {args.sidecar_every}), {args.rounds} round(s), {built}\n")
        print("| exporter | background CPU per step | output per step |")
        print("|---|---|---|")
        for name in names:
            values = sorted(cpu[name])
            median = values[len(values) // 2]
            spread = f" ({values[0] * 1e3:.2f}-{values[-1] * 1e3:.2f})" if len(values) > 1 else ""
            print(f"| {name} | {median * 1e3:.2f} ms{spread} | {out[name]} |")
    if args.paced:
        steady = [r for r in reports[1:] if r.mode != "deep" and r.aborted is None][:args.paced + PACED_WARMUP]
        as_handed_over(steady)
        with tempfile.TemporaryDirectory() as d:
            exporters = [OTelSpanExporter(identity, span_exporter=EncodingSpanExporter()),
                         PrometheusExporter(identity, http=False, sidecar_dir=os.path.join(d, "sidecar")),
                         JSONLExporter(os.path.join(d, "run.jsonl"))]
            per_step = paced(steady, exporters, args.period, PACED_WARMUP)
        print(f"\npaced, all three at once on their own clocks: {per_step * 1e3:.2f} ms per step "
              f"({len(steady) - PACED_WARMUP} light steps after {PACED_WARMUP}, one per {args.period:g} s)")


if __name__ == "__main__":
    main()
