"""What a rank emits per step is bounded: OpenTelemetry spans and OTLP bytes, Prometheus series.

A real 2-rank FSDP2 run with M=100 FSDP modules, deep_every=100, default exporter settings:
spans are encoded with the OTLP exporter's own protobuf encoder, one request per step. Budgets
(issue "fleet scale", averaged over 1,000 steps): at most 10 spans and 20 KB of OTLP per step;
the default Prometheus exposition at most 3 series per module plus 100. The run is 200 steps
(1,000 take over 10 minutes on CI's two cores): its window holds 3 steps with module spans (1,
100, 200) where 1,000 steps hold 11, so the 200-step average is the stricter one.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_mem_otel import catalog as cat
from tests.dist import run_ranks

MODULES = 100  # FSDP modules: 99 blocks and the root
STEPS = 200
DEEP_EVERY = 100
WIDTH = 8
MAX_SPANS_PER_STEP = 10
MAX_OTLP_BYTES_PER_STEP = 20 * 1024


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


def budget_run() -> Emitted:
    """Rank body: train M=100 FSDP modules for STEPS steps with the default exporters."""
    import torch
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from fsdp_mem_otel import FSDPMemoryTracker
    from fsdp_mem_otel.config import TrackerConfig
    from fsdp_mem_otel.demo import make_batch, train_step
    from fsdp_mem_otel.exporters.otel import OTelSpanExporter
    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(MODULES - 1)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    spans = InMemorySpanExporter()
    otel = OTelSpanExporter(span_exporter=spans)
    prom = PrometheusExporter(http=False)
    tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig(deep_every=DEEP_EVERY), exporters=[otel, prom])
    deep = []
    rank = torch.distributed.get_rank()
    with tracker:
        for step in range(1, STEPS + 1):
            train_step(model, opt, make_batch(step, 4, WIDTH, rank))
            if tracker.step().mode == "deep":
                deep.append(step)
        otel.force_flush(timeout=60)
        text = generate_latest(prom.registry).decode()
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
        errors=tracker.errors_total + otel.errors_total + prom.errors_total,
    )


def test_spans_and_series_per_step_stay_in_budget() -> None:
    for rank in run_ranks(budget_run, timeout=900):
        assert rank.errors == 0
        assert rank.fsdp_modules == MODULES
        assert sorted(rank.spans_per_step) == list(range(1, STEPS + 1))  # a step span every step
        # module spans on step 1, every 100th and the deep steps (here the same ones), nothing lost
        assert rank.deep_steps == list(range(DEEP_EVERY, STEPS + 1, DEEP_EVERY))
        assert rank.module_span_steps == [1, *rank.deep_steps]
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
