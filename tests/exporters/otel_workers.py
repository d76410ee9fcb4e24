"""Helpers for the OpenTelemetry exporter tests: a local OTLP/HTTP receiver, a collector that
accepts connections and never answers, span -> plain data, and the code that runs on each of the
2 real ranks (spawned by tests/dist.py; torch is imported inside the worker)."""

from __future__ import annotations

import gzip
import os
import socket
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BLOCKS, WIDTH, BATCH, STEPS = 3, 64, 8, 4
#: the down / hanging scenarios: seconds one OTLP request may take, and what shutdown may wait
EXPORT_TIMEOUT, SHUTDOWN_TIMEOUT = 2.0, 1.0
FAULT_STEPS = 8


# -- span data, both from the SDK (in memory) and from OTLP protobuf -------------------------
def readable_span_data(span: Any) -> dict[str, Any]:
    """An SDK ReadableSpan as plain, picklable data (ids as hex strings)."""
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else "",
        "start": span.start_time,
        "end": span.end_time,
        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
        "events": [
            {"name": e.name, "time": e.timestamp, "attributes": {k: _plain(v) for k, v in (e.attributes or {}).items()}}
            for e in span.events
        ],
        "status": span.status.status_code.name,
        "resource": {k: _plain(v) for k, v in span.resource.attributes.items()},
    }


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _any_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if kind is None:
        return None
    return getattr(v, kind)


def otlp_span_data(body: bytes) -> list[dict[str, Any]]:
    """Decode an OTLP/HTTP protobuf export request body into the same plain span data."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        resource = {a.key: _any_value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({
                    "name": s.name,
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "start": s.start_time_unix_nano,
                    "end": s.end_time_unix_nano,
                    "attributes": {a.key: _any_value(a.value) for a in s.attributes},
                    "events": [
                        {"name": e.name, "time": e.time_unix_nano,
                         "attributes": {a.key: _any_value(a.value) for a in e.attributes}}
                        for e in s.events
                    ],
                    "status": {0: "UNSET", 1: "OK", 2: "ERROR"}[s.status.code],
                    "resource": resource,
                    "scope": ss.scope.name,
                })
    return out


# -- collectors -------------------------------------------------------------------------------
class OTLPReceiver:
    """A minimal OTLP/HTTP trace receiver on 127.0.0.1: POST /v1/traces, protobuf bodies."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.requests: list[dict[str, str]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = otlp_span_data(body)
                with receiver.lock:
                    receiver.requests.append({"path": self.path, "content_type": self.headers.get("Content-Type", "")})
                    receiver.spans.extend(spans)
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class HangingCollector:
    """Accepts TCP connections on 127.0.0.1 and never answers (a wedged collector)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            self._conns.append(conn)  # held open, never read, never answered

    def __enter__(self) -> HangingCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
        for c in self._conns:
            c.close()
        self.sock.close()


def closed_port() -> int:
    """A port on 127.0.0.1 with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- rank side --------------------------------------------------------------------------------
def _otlp_exporter(endpoint: str, **kwargs: Any) -> Any:
    """An OTelSpanExporter whose default span exporter comes from OTEL_EXPORTER_OTLP_ENDPOINT."""
    from fsdp_mem_otel.exporters.otel import OTelSpanExporter

    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    try:
        return OTelSpanExporter(**kwargs)
    finally:
        del os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]


def _train(exporters: list[Any], steps: int, pause: float = 0.0) -> dict[str, Any]:
    """Train ``steps`` steps with the tracker; ``pause`` seconds after each (so that the span
    processor's 50 ms schedule starts exports while the loop still runs, however fast it is)."""
    import torch.distributed as dist

    from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    rank = dist.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=2))
    tracker = FSDPMemoryTracker(model, opt, exporters=exporters)
    reports, step_calls = [], []
    t0 = time.perf_counter()
    with tracker:
        for step in range(steps):
            train_step(model, opt, make_batch(step, BATCH, WIDTH, rank), on_inputs=tracker.track_inputs)
            t = time.perf_counter()
            reports.append(tracker.step())
            step_calls.append(time.perf_counter() - t)
            time.sleep(pause)
    loop = time.perf_counter() - t0
    t = time.perf_counter()
    tracker.close()
    return {
        "reports": [r.to_dict() for r in reports],
        "step_call_seconds": step_calls,
        "loop_seconds": loop,
        "close_seconds": time.perf_counter() - t,
        "tracker_errors": tracker.errors_total,
        "exporter_errors": [e.errors_total for e in exporters],
    }


def train_all(otlp_url: str, down_url: str, hanging_url: str) -> dict[str, Any]:
    """Rank side of the real tests, one spawn for all of them.

    1. FSDP2 training with three exporters at once: in memory (every step), in memory
       (spans_every=2), OTLP/HTTP to the test's receiver (from OTEL_EXPORTER_OTLP_ENDPOINT).
    2. The same against an endpoint with nothing listening, then one that never answers, with a
       short export timeout and a 50 ms batch delay so exports run while the steps do.
    """
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from fsdp_mem_otel.exporters.otel import OTelSpanExporter

    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    mem_all, mem_every2 = InMemorySpanExporter(), InMemorySpanExporter()
    exporters = [
        OTelSpanExporter(span_exporter=mem_all, module_spans_every=1),
        OTelSpanExporter(span_exporter=mem_every2, spans_every=2, module_spans_every=1),
        _otlp_exporter(otlp_url, module_spans_every=1),
    ]
    out: dict[str, Any] = {"real": _train(exporters, STEPS)}
    out["real"]["otlp_type"] = type(exporters[2].span_exporter).__name__
    out["spans_all"] = [readable_span_data(s) for s in mem_all.get_finished_spans()]
    out["spans_every2"] = [readable_span_data(s) for s in mem_every2.get_finished_spans()]
    out["shutdown_twice"] = [e.shutdown() for e in exporters]  # already shut by tracker.close()

    faults = {"down": down_url, "hanging": hanging_url}
    for name, url in faults.items():
        exp = _otlp_exporter(url, export_timeout=EXPORT_TIMEOUT, shutdown_timeout=SHUTDOWN_TIMEOUT,
                             schedule_delay_millis=50)
        out[name] = _train([exp], FAULT_STEPS, pause=0.05)
        out[name]["steps_exported"] = exp.steps_exported
    return out
