"""OpenTelemetry exporter: span layout of synthetic reports, configuration from the environment,
fault containment, and a real 2-rank FSDP2 run exported in memory and over OTLP/HTTP to a local
receiver, plus a collector that is down and one that hangs."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fsdp_mem_otel.exporters import otel
from fsdp_mem_otel.exporters.otel import OTelSpanExporter, mem_attr, peak_attr
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import CATEGORY_KEYS, ModuleReport, StepAbort, StepReport
from tests.dist import run_ranks
from tests.exporters import otel_workers as w

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = Identity("train", 1, 1, 2, "host-a", pod="train-1", namespace="ml", node="node-7", pod_uid="uid-1")
OTEL_ENV = (
    "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED", "FSDP_MEM_OTEL_OTEL_CONSOLE", "OTEL_TRACES_SAMPLER",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)


def b(total: int) -> dict[str, dict[str, int]]:
    cats = dict.fromkeys(CATEGORY_KEYS, 0)
    cats["activation"] = total // 2
    cats["total"] = total
    return {"cpu": cats}


def nested_report(step: int = 1, aborted: StepAbort | None = None) -> StepReport:
    """Root -> layers.0 -> layers.0.fc1 forward; backward where layers.0 ends after the root (as
    FSDP2 does), layers.0.fc1 recomputed under activation checkpointing."""
    ms = 1_000_000
    t0 = 1_700_000_000_000_000_000
    mods = {
        "<root>": ModuleReport(
            {"before_pre_forward": [b(100)], "peak_forward": [b(900)], "after_post_forward": [b(300)],
             "before_pre_backward": [b(300)], "after_post_backward": [b(200)]},
            {"before_pre_forward": [t0 + 1 * ms], "peak_forward": [t0 + 20 * ms], "after_post_forward": [t0 + 20 * ms],
             "before_pre_backward": [t0 + 21 * ms], "after_post_backward": [t0 + 50 * ms]},
        ),
        "layers.0": ModuleReport(
            {"before_pre_forward": [b(110)], "after_post_forward": [b(250)], "before_pre_backward": [b(260)],
             "peak_backward": [b(700)], "after_post_backward": [b(210)]},
            {"before_pre_forward": [t0 + 2 * ms], "after_post_forward": [t0 + 10 * ms],
             "before_pre_backward": [t0 + 40 * ms], "peak_backward": [t0 + 52 * ms],
             "after_post_backward": [t0 + 52 * ms]},
        ),
        "layers.0.fc1": ModuleReport(
            {"before_pre_forward": [b(120)], "after_post_forward": [b(130)], "pre_forward_ac": [b(140)],
             "before_pre_backward": [b(150)], "after_post_backward": [b(160)]},
            {"before_pre_forward": [t0 + 3 * ms], "after_post_forward": [t0 + 5 * ms],
             "pre_forward_ac": [t0 + 41 * ms], "before_pre_backward": [t0 + 42 * ms],
             "after_post_backward": [t0 + 45 * ms]},
        ),
    }
    if aborted is not None:  # the backward of layers.0 never finished
        mods["layers.0"].times["after_post_backward"] = []
        mods["layers.0"].snapshots["after_post_backward"] = []
        mods["layers.0"].times["peak_backward"] = []
        mods["layers.0"].snapshots["peak_backward"] = []
    return StepReport(
        step=step, rank=1, world_size=2, mode="light", fsdp_version=2, peak=b(900), modules=mods,
        module_order=list(mods), errors_total=3, start_time_ns=t0, end_time_ns=t0 + 60 * ms, aborted=aborted,
    )


def export_spans(*reports: StepReport, **kwargs: Any) -> tuple[OTelSpanExporter, list[dict[str, Any]]]:
    mem = InMemorySpanExporter()
    kwargs.setdefault("module_spans_every", 1)  # the layout tests look at every step's modules
    exp = OTelSpanExporter(IDENTITY, span_exporter=mem, **kwargs)
    for r in reports:
        exp.export(r)
    exp.shutdown()
    return exp, [w.readable_span_data(s) for s in mem.get_finished_spans()]


def by_name(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {s["name"]: s for s in spans}
    assert len(out) == len(spans), "span names are unique within one step here"
    return out


# -- synthetic reports --------------------------------------------------------------------------
def test_layout_parents_times_and_events() -> None:
    report = nested_report()
    exp, spans = export_spans(report)
    assert exp.errors_total == 0
    s = by_name(spans)
    assert set(s) == {"fsdp.step", "fsdp.forward <root>", "fsdp.forward layers.0", "fsdp.forward layers.0.fc1",
                      "fsdp.backward <root>", "fsdp.backward layers.0", "fsdp.backward layers.0.fc1"}
    step = s["fsdp.step"]
    assert step["parent_span_id"] == ""
    assert {x["trace_id"] for x in spans} == {step["trace_id"]}
    parent = {x["name"]: next((p["name"] for p in spans if p["span_id"] == x["parent_span_id"]), None) for x in spans}
    assert parent == {
        "fsdp.step": None,
        "fsdp.forward <root>": "fsdp.step",
        "fsdp.forward layers.0": "fsdp.forward <root>",
        "fsdp.forward layers.0.fc1": "fsdp.forward layers.0",
        "fsdp.backward <root>": "fsdp.step",
        "fsdp.backward layers.0": "fsdp.backward <root>",  # starts inside the root's, ends after it
        "fsdp.backward layers.0.fc1": "fsdp.backward layers.0",
    }
    assert (step["start"], step["end"]) == (report.start_time_ns, report.end_time_ns)
    for key, mod in report.modules.items():
        f, bw = s[f"fsdp.forward {key}"], s[f"fsdp.backward {key}"]
        assert (f["start"], f["end"]) == (mod.times["before_pre_forward"][0], mod.times["after_post_forward"][0])
        assert bw["start"] == mod.times["before_pre_backward"][0]
        assert f["attributes"] == {"fsdp.module": key, "fsdp.pass": "forward", "fsdp.call": 0,
                                   **({"fsdp.peak.total.bytes": 900} if key == "<root>" else {})}
    # every snapshot is an event on its module's span of the same pass, with its exact bytes
    events = {(e["attributes"].get("fsdp.module", x["attributes"].get("fsdp.module")), e["name"], e["time"]):
              (name, e["attributes"]) for name, x in s.items() for e in x["events"]}
    for key, mod in report.modules.items():
        for state, calls in mod.snapshots.items():
            span_name, attrs = events[(key, state, mod.times[state][0])]
            want = {"fsdp.device": "cpu", **{mem_attr(c): v for c, v in calls[0]["cpu"].items()}}
            if state == "pre_forward_ac":  # the recompute runs inside the enclosing block's backward
                assert span_name == "fsdp.backward layers.0"
                want.update({"fsdp.module": key, "fsdp.call": 0})
            else:
                assert span_name == f"fsdp.{'backward' if 'backward' in state else 'forward'} {key}"
            assert attrs == want
    for x in spans:  # events in time order, inside their span
        times = [e["time"] for e in x["events"]]
        assert times == sorted(times) and all(x["start"] <= t <= x["end"] for t in times)
    assert step["attributes"] == {
        "fsdp.step": 1, "fsdp.mode": "light", "fsdp.version": 2, "fsdp.errors_total": 3,
        "fsdp.exporter.errors_total": 0, "fsdp.tracker_overhead_seconds": 0.0, "fsdp.device": "cpu",
        "fsdp.devices": ["cpu"], **{peak_attr(c): v for c, v in b(900)["cpu"].items()}, "fsdp.module_spans": True,
    }
    assert [e["name"] for e in step["events"]] == ["peak"]
    assert step["status"] == "UNSET"


def test_resource_identity_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    res = otel.build_resource(IDENTITY).attributes
    assert {k: res[k] for k in ("service.name", "service.instance.id", "job_name", "rank", "local_rank", "world_size",
                                "host.name", "k8s.pod.name", "k8s.namespace.name", "k8s.node.name", "k8s.pod.uid")} == {
        "service.name": "fsdp-mem-otel", "service.instance.id": "train/rank-1", "job_name": "train", "rank": 1,
        "local_rank": 1, "world_size": 2, "host.name": "host-a", "k8s.pod.name": "train-1",
        "k8s.namespace.name": "ml", "k8s.node.name": "node-7", "k8s.pod.uid": "uid-1",
    }
    assert "k8s.pod.name" not in otel.build_resource(Identity("j", 0, 0, 1, "h")).attributes
    # the environment names the service and adds attributes; the identity wins on conflicts
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,rank=9,service.name=from-attrs")
    res = otel.build_resource(IDENTITY).attributes
    assert (res["service.name"], res["deployment.environment"], res["rank"]) == ("from-attrs", "prod", 1)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-train")
    assert otel.build_resource(IDENTITY).attributes["service.name"] == "llm-train"
    assert otel.build_resource(IDENTITY, "explicit").attributes["service.name"] == "explicit"


def test_default_span_exporter_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    off = OTelSpanExporter(IDENTITY)
    assert not off.enabled and off.span_exporter is None
    off.export(nested_report())  # no-op
    off.shutdown()
    off.shutdown()
    monkeypatch.setenv("FSDP_MEM_OTEL_OTEL_CONSOLE", "1")
    assert isinstance(OTelSpanExporter(IDENTITY).span_exporter, ConsoleSpanExporter)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")  # wins over the console
    otlp = OTelSpanExporter(IDENTITY, export_timeout=0.5)
    assert type(otlp.span_exporter).__name__ == "OTLPSpanExporter"
    assert otlp.span_exporter._endpoint == "http://127.0.0.1:1/v1/traces"  # type: ignore[union-attr]
    otlp.shutdown()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/custom")
    otlp = OTelSpanExporter(IDENTITY)
    assert otlp.span_exporter._endpoint == "http://127.0.0.1:1/custom"  # type: ignore[union-attr]
    otlp.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not OTelSpanExporter(IDENTITY).enabled


def test_argument_validation() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="spans_every"):
            OTelSpanExporter(IDENTITY, spans_every=bad)
    for bad_type in ("2", 2.0, True):
        with pytest.raises(TypeError, match="spans_every"):
            OTelSpanExporter(IDENTITY, spans_every=bad_type)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="identity"):
        OTelSpanExporter("rank0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="export_timeout"):
        OTelSpanExporter(IDENTITY, export_timeout=0)


def test_spans_every_and_aborted_steps() -> None:
    abort = StepAbort("OutOfMemoryError", "CUDA out of memory", True, "layers.0", "before_pre_backward", b(999))
    reports = [nested_report(step) for step in range(1, 7)] + [nested_report(7, abort)]
    _, spans = export_spans(*reports, spans_every=3)
    steps = [x for x in spans if x["name"] == "fsdp.step"]
    assert [x["attributes"]["fsdp.step"] for x in steps] == [1, 3, 6, 7]  # 1, every 3rd, and the abort
    last = steps[-1]
    assert last["status"] == "ERROR"
    assert {k: last["attributes"][k] for k in ("fsdp.aborted.error", "fsdp.aborted.oom", "fsdp.aborted.module",
                                               "fsdp.aborted.state")} == {
        "fsdp.aborted.error": "OutOfMemoryError", "fsdp.aborted.oom": True, "fsdp.aborted.module": "layers.0",
        "fsdp.aborted.state": "before_pre_backward"}
    open_call = next(x for x in spans if x["trace_id"] == last["trace_id"] and x["name"] == "fsdp.backward layers.0")
    assert open_call["attributes"]["fsdp.incomplete"] is True
    assert open_call["end"] == last["end"]


def test_module_spans_on_first_sampled_and_aborted_steps() -> None:
    abort = StepAbort("OutOfMemoryError", "CUDA out of memory", True, "layers.0", "before_pre_backward", b(999))
    reports = [nested_report(step) for step in range(1, 12)] + [nested_report(12, abort)]
    reports[6].mode = "deep"  # step 7
    _, spans = export_spans(*reports, module_spans_every=5)
    _, every = export_spans(*reports, module_spans_every=1)

    def traces(spans: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
        steps = {x["trace_id"]: x["attributes"]["fsdp.step"] for x in spans if x["name"] == "fsdp.step"}
        out: dict[int, list[dict[str, Any]]] = {}
        for x in spans:
            out.setdefault(steps[x["trace_id"]], []).append(x)
        return out

    budgeted, full = traces(spans), traces(every)
    assert sorted(budgeted) == list(range(1, 13))  # every step has its step span (spans_every=1)
    with_modules = {1, 5, 10, 12}  # first, every 5th, the aborted one; a deep step (7) is no exception
    for step, trace in budgeted.items():
        span = next(x for x in trace if x["name"] == "fsdp.step")
        assert span["attributes"]["fsdp.module_spans"] is (step in with_modules)
        if step in with_modules:  # the whole layout, events included
            assert sorted((x["name"], len(x["events"])) for x in trace) == sorted(
                (x["name"], len(x["events"])) for x in full[step])
            assert len(trace) > 1
        else:  # the step-level breakdown stays, on the step span and its peak event
            assert trace == [span]
            assert span["attributes"][peak_attr("total")] == reports[step - 1].peak["cpu"]["total"]
            assert [e["name"] for e in span["events"]] == ["peak"]
    with pytest.raises(ValueError, match="module_spans_every"):
        OTelSpanExporter(IDENTITY, module_spans_every=0)


def test_the_sdk_sampler_decides_per_step_and_keeps_traces_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    reports = [nested_report(step) for step in range(1, 41)]
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exp, spans = export_spans(*reports)
    assert spans == [] and exp.errors_total == 0
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    exp, spans = export_spans(*reports)
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for x in spans:
        traces[x["trace_id"]].append(x)
    assert 0 < len(traces) < len(reports)  # 40 steps at 1/2: some in, some out (odds 2 x 2^-40 otherwise)
    for trace in traces.values():  # a sampled step keeps all of its spans: step span and 6 module spans
        assert len(trace) == 7 and sum(x["name"] == "fsdp.step" for x in trace) == 1
    assert exp.errors_total == 0


class Failing(SpanExporter):
    def __init__(self, how: str) -> None:
        self.how = how
        self.calls = 0

    def export(self, spans: Any) -> SpanExportResult:
        self.calls += 1
        if self.how == "raise":
            raise ConnectionError("collector gone")
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        raise RuntimeError("shutdown failed too")


@pytest.mark.parametrize("how", ["raise", "failure"])
def test_failures_counted_never_raised(how: str, caplog: pytest.LogCaptureFixture) -> None:
    inner = Failing(how)
    exp = OTelSpanExporter(IDENTITY, span_exporter=inner, module_spans_every=1)
    exp.export(nested_report(1))
    exp.export(nested_report(2))
    exp.export("not a report")  # type: ignore[arg-type]
    assert exp.errors_total == 1  # refused at once; the good reports are queued
    broken = nested_report(3)
    broken.modules["layers.0"].snapshots["after_post_forward"] = [None]  # type: ignore[list-item]
    exp.export(broken)  # fails half-way on the span-building thread
    assert exp.force_flush(timeout=5)
    exp.shutdown()
    exp.shutdown()
    assert inner.calls >= 1
    assert exp.errors_total >= 4  # bad report + broken report + >= 1 failed batch + the failing shutdown
    warnings = [r for r in caplog.records if r.name.startswith("fsdp_mem_otel") and "OTel exporter" in r.getMessage()]
    assert len(warnings) == 4  # logged once per kind: queueing, building spans, sending, shutdown
    exp.export(nested_report(4))  # after shutdown: ignored, no error
    assert exp.steps_exported == 2


def test_export_never_waits_for_a_lagging_span_builder() -> None:
    mem = InMemorySpanExporter()
    exp = OTelSpanExporter(IDENTITY, span_exporter=mem, max_pending_steps=1)
    release = threading.Event()
    real_emit = exp._emit
    def slow_emit(report: StepReport) -> None:
        release.wait(10)
        real_emit(report)

    exp._emit = slow_emit  # type: ignore[method-assign]
    t = time.perf_counter()
    exp.export(nested_report(1))  # taken by the builder, which now hangs
    deadline = time.monotonic() + 5
    while exp._worker.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    exp.export(nested_report(2))  # waits in the queue
    exp.export(nested_report(3))  # queue full: the oldest waiting (step 2) is dropped and counted
    assert time.perf_counter() - t < 1.0
    assert exp.errors_total == 1
    release.set()
    exp.shutdown()
    spans = [w.readable_span_data(s) for s in mem.get_finished_spans()]
    # the shared worker's policy (fsdp_mem_otel.exporters.worker): under pressure the newest steps are kept
    assert sorted(x["attributes"]["fsdp.step"] for x in spans if x["name"] == "fsdp.step") == [1, 3]


def test_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import fsdp_mem_otel.exporters.otel as m\n"
        "m.OTelSpanExporter(span_exporter=m.ConsoleSpanExporter()).shutdown()\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# -- a real 2-rank FSDP2 run ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def real() -> Iterator[dict[str, Any]]:
    """Per rank results of otel_workers.train_all, plus what the local OTLP receiver got."""
    with w.OTLPReceiver() as receiver, w.HangingCollector() as hanging:
        down = f"http://127.0.0.1:{w.closed_port()}"
        per_rank = run_ranks(w.train_all, receiver.url, down, hanging.url, timeout=240)
        yield {"ranks": per_rank, "received": list(receiver.spans), "requests": list(receiver.requests),
               "hanging_accepted": hanging.accepted}


def _traces(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        out[s["trace_id"]].append(s)
    return out


def _by_step(traces: dict[str, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    return {next(s for s in t if s["name"] == "fsdp.step")["attributes"]["fsdp.step"]: t for t in traces.values()}


def _check_trace(trace: list[dict[str, Any]], report: dict[str, Any]) -> None:
    """One step's spans against its StepReport (as to_dict())."""
    (step,) = [s for s in trace if s["name"] == "fsdp.step"]
    assert step["attributes"]["fsdp.step"] == report["step"]
    assert (step["start"], step["end"]) == (report["start_time_ns"], report["end_time_ns"])
    assert step["parent_span_id"] == ""
    (dev,) = report["peak"]
    assert {peak_attr(c): v for c, v in report["peak"][dev].items()} == {
        k: v for k, v in step["attributes"].items() if k.startswith("fsdp.peak.")}
    ids = {s["span_id"]: s for s in trace}
    modules = [s for s in trace if s is not step]
    assert len(modules) == 2 * len(report["modules"]) == 8  # <root> + 3 blocks, forward and backward
    for s in modules:
        key, pass_ = s["attributes"]["fsdp.module"], s["attributes"]["fsdp.pass"]
        assert s["name"] == f"fsdp.{pass_} {key}"
        parent = ids[s["parent_span_id"]]
        # blocks hang under the root's span of the same pass; the root under the step
        assert parent["name"] == ("fsdp.step" if key == "<root>" else f"fsdp.{pass_} <root>")
        assert step["start"] <= s["start"] <= s["end"] <= step["end"]
        times = report["modules"][key]["times"]
        first, last = ("before_pre_forward", "after_post_forward") if pass_ == "forward" else (
            "before_pre_backward", "after_post_backward")
        assert (s["start"], s["end"]) == (times[first][0], times[last][0])
        # events: every snapshot of this pass, exact bytes, at the snapshot's time, in time order
        want = sorted(
            (times[state][0], state, {"fsdp.device": d, **{mem_attr(c): v for c, v in cats.items()}})
            for state, calls in report["modules"][key]["snapshots"].items()
            if (state.endswith("backward")) == (pass_ == "backward")
            for d, cats in calls[0].items()
        )
        got = [(e["time"], e["name"], e["attributes"]) for e in s["events"]]
        assert got == want
    # siblings are time ordered: blocks forward 0, 1, 2 then backward 2, 1, 0
    fwd = sorted((s for s in modules if s["name"].startswith("fsdp.forward layers")), key=lambda s: s["start"])
    bwd = sorted((s for s in modules if s["name"].startswith("fsdp.backward layers")), key=lambda s: s["start"])
    assert [s["attributes"]["fsdp.module"] for s in fwd] == ["layers.0", "layers.1", "layers.2"]
    assert [s["attributes"]["fsdp.module"] for s in bwd] == ["layers.2", "layers.1", "layers.0"]
    for seq in (fwd, bwd):
        for a, c in zip(seq, seq[1:], strict=False):
            assert a["end"] <= c["start"]


def test_real_in_memory_spans_match_reports(real: dict[str, Any]) -> None:
    for rank, res in enumerate(real["ranks"]):
        reports = res["real"]["reports"]
        assert res["real"]["tracker_errors"] == 0 and res["real"]["exporter_errors"] == [0, 0, 0]
        traces = _traces(res["spans_all"])
        assert len(traces) == w.STEPS
        by_step = _by_step(traces)
        assert sorted(by_step) == [r["step"] for r in reports] == list(range(1, w.STEPS + 1))
        for report in reports:
            _check_trace(by_step[report["step"]], report)
        resource = res["spans_all"][0]["resource"]
        job = resource["job_name"]
        keys = ("rank", "local_rank", "world_size", "service.name", "service.instance.id")
        assert {k: resource[k] for k in keys} == {
            "rank": rank, "local_rank": rank, "world_size": 2, "service.name": "fsdp-mem-otel",
            "service.instance.id": f"{job}/rank-{rank}"}


def test_real_spans_every(real: dict[str, Any]) -> None:
    for res in real["ranks"]:
        steps = sorted(s["attributes"]["fsdp.step"] for s in res["spans_every2"] if s["name"] == "fsdp.step")
        assert steps == [1, 2, 4]
        assert len(res["spans_every2"]) == 3 * 9


def test_real_otlp_http(real: dict[str, Any]) -> None:
    """Spans from both ranks reach the receiver as OTLP protobuf with parentage and attributes."""
    assert real["requests"] and {r["path"] for r in real["requests"]} == {"/v1/traces"}
    assert {r["content_type"] for r in real["requests"]} == {"application/x-protobuf"}
    received = real["received"]
    assert {s["scope"] for s in received} == {"fsdp_mem_otel"}
    for rank, res in enumerate(real["ranks"]):
        assert res["real"]["otlp_type"] == "OTLPSpanExporter"
        mine = [s for s in received if s["resource"]["rank"] == rank]
        assert mine and all(s["resource"]["world_size"] == 2 for s in mine)
        assert len(mine) == len(res["spans_all"]) == w.STEPS * 9
        traces = _traces(mine)
        by_step = _by_step(traces)
        for report in res["real"]["reports"]:
            _check_trace(by_step[report["step"]], report)


@pytest.mark.parametrize("fault", ["down", "hanging"])
def test_real_collector_faults_never_block_training(real: dict[str, Any], fault: str) -> None:
    for res in real["ranks"]:
        r = res[fault]
        assert len(r["reports"]) == w.FAULT_STEPS and r["steps_exported"] == w.FAULT_STEPS
        assert r["tracker_errors"] == 0  # nothing raised into the tracker
        assert r["exporter_errors"][0] >= 1  # ... but the exporter counted its failures
        assert max(r["step_call_seconds"]) < w.EXPORT_TIMEOUT / 4, r["step_call_seconds"]
        assert r["close_seconds"] < w.SHUTDOWN_TIMEOUT + 2.0, r["close_seconds"]
    if fault == "hanging":
        assert real["hanging_accepted"] >= 1  # an export really was stuck while the steps ran
        for res in real["ranks"]:
            assert res["hanging"]["loop_seconds"] > 0.2  # exports started during the loop (50 ms delay)
