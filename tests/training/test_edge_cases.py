"""Odd but legal use: documented behaviour, clear errors, never a crash of training."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_mem_otel.schema import StepReport
from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH

ODD_NAMES = ('blk "quoted"', "blk{brace}=1", "blk\\back", "blk-é-ü", "blk\nnewline")


class OddNames(nn.Module):
    """Blocks under names with characters special to Prometheus labels and JSON."""

    def __init__(self) -> None:
        super().__init__()
        from fsdp_mem_otel.tools.demo import Block

        self.blocks = nn.ModuleDict({name: Block(WIDTH) for name in ODD_NAMES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks.values():
            x = b(x)
        return x


@dataclass(frozen=True)
class EdgeCaseResult:
    empty: list[dict[str, Any]]  # the reports of step() before any forward, twice in a row
    thread_error: list[str]  # what step() from another thread raised
    keys: list[str]  # the tracker's module keys
    json_keys: list[str]  # the module keys of the report's JSON
    report: dict[str, Any]  # that report, StepReport.to_dict()
    errors: int
    foreign_error: str  # what a tracker for an optimizer over another model's parameters raised


def edge_cases(fsdp: int) -> EdgeCaseResult:
    """step() with no forward, twice in a row, from another thread; odd module names."""
    import threading

    from fsdp_mem_otel.tools.demo import Block

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model: nn.Module = OddNames()
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks.values():  # type: ignore[operator]
            fully_shard(b)
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters())
    foreign_error = ""
    try:
        FSDPMemoryTracker(model, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    except ValueError as exc:
        foreign_error = str(exc)
    tracker = FSDPMemoryTracker(model, opt).attach()
    empty1 = tracker.step().to_dict()
    empty2 = tracker.step().to_dict()
    thread_error: list[str] = []

    def from_thread() -> None:
        try:
            tracker.step()
        except RuntimeError as exc:
            thread_error.append(str(exc))

    t = threading.Thread(target=from_thread)
    t.start()
    t.join()
    train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))
    report = tracker.step()
    text = report.to_json()
    tracker.detach()
    return EdgeCaseResult(
        empty=[empty1, empty2],
        thread_error=thread_error,
        keys=tracker.module_keys,
        json_keys=sorted(json.loads(text)["modules"]),
        report=report.to_dict(),
        errors=tracker.errors_total,
        foreign_error=foreign_error,
    )


SENTINEL = 0.123456789


@dataclass(frozen=True)
class EmittedText:
    """What each exporter emitted for one step, as text."""

    prometheus: str
    spans: str
    jsonl: str


def no_tensor_data(directory: str) -> EmittedText:
    """Parameters and inputs all hold SENTINEL; return what every exporter emitted, as text."""
    import os

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from fsdp_mem_otel.exporters.jsonl import JSONLExporter
    from fsdp_mem_otel.exporters.otel import OTelSpanExporter
    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter

    rank = torch.distributed.get_rank()
    model, _ = build(BLOCKS, WIDTH, WrapOptions(fsdp=2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    spans = InMemorySpanExporter()
    prom = PrometheusExporter(http=False, detail=True)
    path = os.path.join(directory, f"rank{rank}.jsonl")
    jsonl = JSONLExporter(path)
    otel = OTelSpanExporter(span_exporter=spans)
    tracker = FSDPMemoryTracker(model, opt, mode="deep", exporters=[prom, jsonl, otel])
    with tracker:
        x = torch.full((BATCH, WIDTH), SENTINEL)
        train_step(model, opt, x, on_inputs=tracker.track_inputs)
        tracker.step()
    tracker.close()
    from prometheus_client import generate_latest

    span_text = "\n".join(s.to_json() for s in spans.get_finished_spans())
    with open(path) as f:
        jsonl_text = f.read()
    return EmittedText(prometheus=generate_latest(prom.registry).decode(), spans=span_text, jsonl=jsonl_text)


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def edge(request: pytest.FixtureRequest) -> list[EdgeCaseResult]:
    return run_ranks(edge_cases, request.param)


def test_edge_cases(edge: list[EdgeCaseResult], rank: int) -> None:
    res = edge[rank]
    # step() before any forward, and twice in a row: empty reports, counted steps
    assert [r["step"] for r in res.empty] == [1, 2]
    assert all(r["modules"] == {} and r["aborted"] is None for r in res.empty)
    # step() from a second thread: a clear error naming the rule
    assert len(res.thread_error) == 1 and "thread that called attach()" in res.thread_error[0]
    # module names with quotes, braces, backslashes, non-ASCII and newlines survive as keys
    expected = sorted(["<root>"] + [f"blocks.{n}" for n in ODD_NAMES])
    assert sorted(res.keys) == expected == res.json_keys
    report = StepReport.from_dict(json.loads(json.dumps(res.report)))
    assert report.step == 3 and sorted(report.modules) == expected
    assert res.errors == 0
    # an optimizer over parameters of another model: a clear error
    assert "optimizer does not optimize any parameter of model" in res.foreign_error


@pytest.fixture(scope="module")
def emitted(tmp_path_factory: pytest.TempPathFactory) -> list[EmittedText]:
    return run_ranks(no_tensor_data, str(tmp_path_factory.mktemp("no_tensor_data")))


@pytest.mark.parametrize("exporter", [f.name for f in fields(EmittedText)])
def test_no_tensor_data_leaves_the_process(emitted: list[EmittedText], rank: int, exporter: str) -> None:
    needle = repr(SENTINEL)[2:9]  # "1234567": any rendering of the sentinel value
    text = getattr(emitted[rank], exporter)
    assert text, exporter  # each exporter did emit
    assert needle not in text, exporter
