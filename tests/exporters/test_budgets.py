"""What a rank emits per step is bounded: OpenTelemetry spans and OTLP bytes, JSONL bytes,
Prometheus series.

A real 2-rank FSDP2 run with M=100 FSDP modules, deep_every=100, default exporter settings:
spans are encoded with the OTLP exporter's own protobuf encoder, one request per step. Budgets
(issue "fleet scale", averaged over 1,000 steps): at most 10 spans and 20 KB of OTLP per step;
at most 8 KB of JSONL per step (data and index files); the default Prometheus exposition at most
3 series per module plus 100. Nothing is lost: the JSONL read back gives every step, with the
module snapshots of the steps that carry them equal to the tracker's own reports. The run is 100 steps
(1,000 take over 10 minutes on CI's two cores): its window holds 1 step with module spans (step 1)
where 1,000 steps hold 2 (1 and 1,000), and 2 JSONL lines with module snapshots (1 and 100, a
deep step) where 1,000 steps hold 11, so the 100-step averages are the stricter ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_mem_otel.fleet import catalog as cat
from tests.dist import run_ranks

MODULES = 100  # FSDP modules: 99 blocks and the root
STEPS = 100
DEEP_EVERY = 100
WIDTH = 8
MAX_SPANS_PER_STEP = 10
MAX_OTLP_BYTES_PER_STEP = 20 * 1024
MAX_JSONL_BYTES_PER_STEP = 8 * 1024


@dataclass
class Emitted:
    steps: int
    fsdp_modules: int
    spans_per_step: dict[int, int]  # step -> spans of its trace
    otlp_bytes_per_step: dict[int, int]  # step -> bytes of one OTLP request with its spans
    module_span_steps: list[int]  # steps whose step span says fsdp.module_spans=true
    deep_steps: list[int]
    series: int  # samples in the default /metrics exposition after the last step
    module_series: int
    errors: int
    jsonl_bytes: int  # data and index files
    jsonl_module_steps: list[int]  # lines that carry module snapshots
    jsonl_read_back: list[str]  # how each step read back compares with the tracker's report


def budget_run(directory: str) -> Emitted:
    """Rank body: train M=100 FSDP modules for STEPS steps with the default exporters."""
    import json
    import os

    import torch
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from fsdp_mem_otel import FSDPMemoryTracker
    from fsdp_mem_otel.config import TrackerConfig
    from fsdp_mem_otel.exporters.jsonl import JSONLExporter
    from fsdp_mem_otel.exporters.otel import OTelSpanExporter
    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
    from fsdp_mem_otel.offline.jsonl_format import read_reports
    from fsdp_mem_otel.tools.demo import make_batch, train_step

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(MODULES - 1)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    spans = InMemorySpanExporter()
    otel = OTelSpanExporter(span_exporter=spans)
    prom = PrometheusExporter(http=False)
    rank = torch.distributed.get_rank()
    path = os.path.join(directory, f"run.rank{rank}.jsonl")
    jsonl = JSONLExporter(path)
    tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig(deep_every=DEEP_EVERY),
                                exporters=[otel, prom, jsonl])
    deep, reports = [], {}
    with tracker:
        for step in range(1, STEPS + 1):
            train_step(model, opt, make_batch(step, 4, WIDTH, rank))
            report = tracker.step()
            reports[step] = report
            if report.mode == "deep":
                deep.append(step)
        otel.force_flush(timeout=60)
        jsonl.flush(timeout=60)
        text = generate_latest(prom.registry).decode()
    carrying = [json.loads(line)["step"] for line in open(path) if '"modules_from"' not in line]
    read_back = []
    for got in read_reports(path):
        mine = reports[got.step]
        source = reports[got.modules_from] if got.modules_from is not None else mine
        step_level = {"modules": None, "module_order": None, "modules_from": None}
        same_step = (got.to_dict() | step_level) == (mine.to_dict() | step_level)
        same_modules = (got.to_dict()["modules"] == source.to_dict()["modules"]
                        and got.module_order == source.module_order)
        read_back.append("ok" if same_step and same_modules else f"step {got.step} differs")
    by_trace: dict[int, list] = {}
    for s in spans.get_finished_spans():
        by_trace.setdefault(s.context.trace_id, []).append(s)
    per_step, bytes_per_step, with_modules = {}, {}, []
    for trace in by_trace.values():
        step_span = next(s for s in trace if s.name == "fsdp.step")
        step = int(step_span.attributes["fsdp.step"])
        per_step[step] = len(trace)
        bytes_per_step[step] = len(encode_spans(trace).SerializeToString())
        if step_span.attributes["fsdp.module_spans"]:
            with_modules.append(step)
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return Emitted(
        steps=STEPS, fsdp_modules=len(tracker.module_keys), spans_per_step=per_step,
        otlp_bytes_per_step=bytes_per_step, module_span_steps=sorted(with_modules), deep_steps=deep,
        series=len(samples), module_series=sum(1 for s in samples if "module" in s.labels),
        errors=tracker.errors_total + otel.errors_total + prom.errors_total + jsonl.errors_total,
        jsonl_bytes=os.path.getsize(path) + os.path.getsize(path + ".index"), jsonl_module_steps=carrying,
        jsonl_read_back=read_back,
    )


def test_spans_jsonl_and_series_per_step_stay_in_budget(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for rank in run_ranks(budget_run, str(tmp_path), timeout=900):
        assert rank.errors == 0
        assert rank.fsdp_modules == MODULES
        assert sorted(rank.spans_per_step) == list(range(1, STEPS + 1))  # a step span every step
        # module spans on step 1 and every 1,000th (so here on step 1 alone: a deep step is no
        # exception), nothing lost
        assert rank.deep_steps == list(range(DEEP_EVERY, STEPS + 1, DEEP_EVERY))
        assert rank.module_span_steps == [1]
        # step span + each module's forward and backward, but the root: it holds no parameter
        # (nn.Sequential of the blocks), so FSDP2 runs no backward hook for it
        full_step = 1 + 2 * MODULES - 1
        for step, n in rank.spans_per_step.items():
            assert n == (full_step if step in rank.module_span_steps else 1), step
        assert sum(rank.spans_per_step.values()) / STEPS <= MAX_SPANS_PER_STEP
        assert sum(rank.otlp_bytes_per_step.values()) / STEPS <= MAX_OTLP_BYTES_PER_STEP
        # Prometheus by default: at most 3 series per module and 100 others
        assert rank.module_series <= cat.MAX_SERIES_PER_MODULE * MODULES
        assert rank.series - rank.module_series <= cat.MAX_OTHER_SERIES
        # JSONL: module snapshots on step 1 and every 100th (the deep steps here; a module's peak
        # moving by over 5% and 64 KiB would add steps, these modules are far smaller)
        assert rank.jsonl_module_steps == [1, *rank.deep_steps]
        assert rank.jsonl_bytes / STEPS <= MAX_JSONL_BYTES_PER_STEP
        assert rank.jsonl_read_back == ["ok"] * STEPS  # every step back, snapshots filled in
