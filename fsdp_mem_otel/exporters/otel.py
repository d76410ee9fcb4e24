"""OpenTelemetry exporter: each StepReport becomes one trace. Does not import torch.

One ``fsdp.step`` span per exported step (start/end from the report), a child span per FSDP module
forward and backward call (``fsdp.forward <key>`` / ``fsdp.backward <key>``, times from
``ModuleReport.times``) and, on those, one span event per state snapshot (event name = state,
timestamp = when the snapshot was taken, attributes = bytes per category).

Parentage: a module span's parent is the innermost module span that was open when it started
(so ``<root>`` -> ``layers.0`` -> ``layers.0.fc1``), else the step span. "Open when it started",
not "contains it end to end": FSDP2 finishes the root's post-backward before the first block's
(measured on torch 2.13), so the last block's backward span starts inside the root's and ends a
few milliseconds after it. The OTel data model allows a child to outlive its parent.

"When" is apart from "where", as in opentelemetry-python: spans go through a ``BatchSpanProcessor``
of the exporter's own ``TracerProvider`` (never the global one), whose worker thread does all
I/O. ``export()`` only puts the report on a bounded queue; a daemon thread builds the spans and
hands them to the processor, so neither span building nor a down or hanging collector ever
holds up a training step. Full queues drop (ours counts it in ``errors_total``; the SDK's logs
it).

The spans of a step are built as finished SDK ``ReadableSpan`` objects, with the provider's
resource, id generator and sampler, not through the ``Tracer`` API: a report's spans are
complete when it arrives (start, end, events, parents), and the Tracer's per-span locking and
per-attribute validation cost as much as encoding them (measured at 100 modules,
``benchmarks/exporter_cpu.py``). What differs from the Tracer: the sampler
(``OTEL_TRACES_SAMPLER``) decides once per step, at the step span, and its module spans follow
it; the ``OTEL_SPAN_*_LIMIT`` variables are not applied (a step span holds ~25 attributes, a
module span ~5 events per call).

Where spans go (the first that applies):

1. ``span_exporter=`` (any ``opentelemetry.sdk.trace.export.SpanExporter``),
2. OTLP/HTTP protobuf when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``
   is set (every other ``OTEL_EXPORTER_OTLP_*`` variable is honoured by the SDK: headers,
   certificates, compression, timeout),
3. the console (one JSON object per span on stdout) when ``FSDP_MEM_OTEL_OTEL_CONSOLE=1``,
4. nowhere: the exporter is off and ``export()`` returns at once. ``OTEL_SDK_DISABLED=true`` also
   turns it off.

Sampling: ``spans_every=N`` exports step 1, then steps N, 2N, 3N, ... (the steps that
``deep_every=N`` runs deep, so the detailed steps get traces), and always a step that aborted
(an OOM is the trace you want). Module spans and their state events (2M+1 spans and ~10M events
for M FSDP modules, ~100 ms of background CPU to build and encode at M=100) go only with step 1,
every ``module_spans_every``-th step (default 1000) and aborted steps (set it to ``deep_every``
for the module spans of every deep step); the other exported steps are the step span alone,
with the step-level breakdown and ``fsdp.module_spans=false`` saying the budget left the modules
out. At M=100 with the defaults that is about 1.4 spans and 2 KB of OTLP per step on average
(tested in ``tests/exporters/test_budgets.py``). The SDK sampler (``OTEL_TRACES_SAMPLER``)
applies on top.

Resource: ``service.name`` is the ``service_name`` argument if given, else ``OTEL_SERVICE_NAME``,
else ``service.name`` from ``OTEL_RESOURCE_ATTRIBUTES``, else "fsdp-mem-otel". Other
``OTEL_RESOURCE_ATTRIBUTES`` entries are kept; on a conflict the identity below wins (a pod
template's attributes must not collapse ranks into one instance).

Attribute names (every name this module emits; constants below):

=============================  ========  =======================================================
name                           where     value
=============================  ========  =======================================================
service.name                   resource  see above
service.instance.id            resource  "<job>/rank-<rank>"
job_name                       resource  Identity.job (same as the Prometheus ``job_name`` label)
rank, local_rank, world_size   resource  ints (same names as the Prometheus identity labels)
host.name                      resource  hostname
k8s.pod.name, k8s.namespace.   resource  from POD_NAME, POD_NAMESPACE, NODE_NAME, POD_UID (only
name, k8s.node.name,                     when set; see fsdp_mem_otel.identity)
k8s.pod.uid
fsdp.step                      step      1-based step number
fsdp.mode                      step      "light" or "deep"
fsdp.version                   step      FSDP generation, 1 or 2
fsdp.device                    step      device of the ``fsdp.peak.*`` attributes (the one
                                         with the largest peak total)
fsdp.devices                   step      every device seen (string array)
fsdp.peak.<category>.bytes     step      step peak per category on ``fsdp.device``
                               module    ``fsdp.peak.total.bytes`` only: peak total during the
                                         call (max over devices)
fsdp.errors_total              step      tracker-internal errors so far
fsdp.exporter.errors_total     step      this exporter's failures so far
fsdp.tracker_overhead_seconds  step      time in the tracker's module-state hooks (one call in 13 timed,
                                         counted for each) and deferred accounting: a lower bound (group
                                         and saved-tensor hooks untimed)
fsdp.module_spans              step      whether this step's module spans were exported
fsdp.warnings                  step      StepReport.warnings, when there are any (string array)
fsdp.leak.growing              step      categories growing step after step (StepReport.leak)
fsdp.leak.<category>.          step      their growth, bytes per step
bytes_per_step
fsdp.leak.held_modules         step      modules whose tensors are alive at the step end (string array)
fsdp.aborted.error             step      exception type name or "IncompleteStep" (status ERROR)
fsdp.aborted.oom, .module,     step      where the step stopped (see model.StepAbort)
.state
fsdp.module                    module    module key (named_modules() path, root "<root>")
fsdp.pass                      module    "forward" or "backward"
fsdp.call                      module    0-based call index within the step
fsdp.incomplete                module    true when the call never finished (span ends with step)
fsdp.mem.<category>.bytes      event     bytes per category at that snapshot (every category,
                                         ``total`` included)
fsdp.device                    event     device of the event's bytes (one event per device)
=============================  ========  =======================================================

Step span events: ``peak`` (one per device, at the step's end) with ``fsdp.mem.*.bytes``.
Events are added in time order. A snapshot that falls in none of its module's spans (the
activation-checkpoint states ``pre_forward_ac`` / ``post_forward_ac``: the recompute runs just
before the module's backward hooks) goes on the innermost span open at that time, else on the
step span, with ``fsdp.module`` and ``fsdp.call`` added to its attributes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from fsdp_mem_otel import __version__, env
from fsdp_mem_otel.config import DEFAULT_MODULE_SPANS_EVERY, OTelConfig
from fsdp_mem_otel.exporters.worker import BackgroundWorker, at_exit
from fsdp_mem_otel.failures import FailureLog
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import (
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    BACKWARD_PASS_STATES,
    BEFORE_PRE_BACKWARD,
    BEFORE_PRE_FORWARD,
    CATEGORY_KEYS,
    FORWARD_STATES,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    ROOT_KEY,
    STATES,
    TOTAL,
    DeviceBreakdown,
    StepReport,
)

logger = logging.getLogger(__name__)

# -- otel_attributes: every name emitted (table in the module docstring) ----------------------
RES_SERVICE_NAME = "service.name"
RES_SERVICE_INSTANCE_ID = "service.instance.id"
RES_JOB = "job_name"
RES_RANK = "rank"
RES_LOCAL_RANK = "local_rank"
RES_WORLD_SIZE = "world_size"
RES_HOST_NAME = "host.name"
RES_K8S_POD_NAME = "k8s.pod.name"
RES_K8S_NAMESPACE_NAME = "k8s.namespace.name"
RES_K8S_NODE_NAME = "k8s.node.name"
RES_K8S_POD_UID = "k8s.pod.uid"

SPAN_STEP = "fsdp.step"
SPAN_FORWARD = "fsdp.forward"  # + " <module key>"
SPAN_BACKWARD = "fsdp.backward"  # + " <module key>"
EVENT_PEAK = "peak"

ATTR_STEP = "fsdp.step"
ATTR_MODE = "fsdp.mode"
ATTR_FSDP_VERSION = "fsdp.version"
ATTR_DEVICE = "fsdp.device"
ATTR_DEVICES = "fsdp.devices"
ATTR_ERRORS = "fsdp.errors_total"
ATTR_EXPORTER_ERRORS = "fsdp.exporter.errors_total"
ATTR_OVERHEAD = "fsdp.tracker_overhead_seconds"
ATTR_MODULE_SPANS = "fsdp.module_spans"
ATTR_WARNINGS = "fsdp.warnings"
ATTR_LEAK_GROWING = "fsdp.leak.growing"
ATTR_LEAK_HELD = "fsdp.leak.held_modules"
ATTR_ABORTED_ERROR = "fsdp.aborted.error"
ATTR_ABORTED_OOM = "fsdp.aborted.oom"
ATTR_ABORTED_MODULE = "fsdp.aborted.module"
ATTR_ABORTED_STATE = "fsdp.aborted.state"
ATTR_MODULE = "fsdp.module"
ATTR_PASS = "fsdp.pass"
ATTR_CALL = "fsdp.call"
ATTR_INCOMPLETE = "fsdp.incomplete"


def peak_attr(category: str) -> str:
    """Step-span attribute for the step peak of ``category`` (module spans: ``total`` only)."""
    return f"fsdp.peak.{category}.bytes"


def mem_attr(category: str) -> str:
    """Event attribute for the bytes of ``category`` at a snapshot."""
    return f"fsdp.mem.{category}.bytes"


_PEAK_ATTRS = {c: peak_attr(c) for c in CATEGORY_KEYS}
_MEM_ATTRS = {c: mem_attr(c) for c in CATEGORY_KEYS}
_SCOPE = InstrumentationScope("fsdp_mem_otel", __version__)
_UNSET = Status(StatusCode.UNSET)

PASS_FORWARD = "forward"
PASS_BACKWARD = "backward"

# -- environment ------------------------------------------------------------------------------
ENV_CONSOLE = env.FSDP_MEM_OTEL_OTEL_CONSOLE
ENV_OTLP_ENDPOINT = env.OTEL_EXPORTER_OTLP_ENDPOINT
ENV_OTLP_TRACES_ENDPOINT = env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
ENV_OTLP_TIMEOUT = env.OTEL_EXPORTER_OTLP_TIMEOUT
ENV_OTLP_TRACES_TIMEOUT = env.OTEL_EXPORTER_OTLP_TRACES_TIMEOUT
ENV_SDK_DISABLED = env.OTEL_SDK_DISABLED
ENV_SERVICE_NAME = env.OTEL_SERVICE_NAME

DEFAULT_SERVICE_NAME = "fsdp-mem-otel"
#: seconds one OTLP export request may take (the SDK's default is 10) unless the env sets one
DEFAULT_EXPORT_TIMEOUT = 5.0
_TRUTHY = ("1", "true", "yes", "on")

# Which pass each state belongs to (for placing its event on the module's spans; a recompute's
# states go on no span).
_FORWARD_STATES = FORWARD_STATES | {PEAK_FORWARD}
_BACKWARD_STATES = BACKWARD_PASS_STATES
_PASSES = (
    (PASS_FORWARD, SPAN_FORWARD, BEFORE_PRE_FORWARD, AFTER_POST_FORWARD, PEAK_FORWARD),
    (PASS_BACKWARD, SPAN_BACKWARD, BEFORE_PRE_BACKWARD, AFTER_POST_BACKWARD, PEAK_BACKWARD),
)


def default_span_exporter(env: Mapping[str, str] | None = None, timeout: float | None = None) -> SpanExporter | None:
    """The span exporter the environment asks for (see the module docstring), or None (off)."""
    env = os.environ if env is None else env
    if env.get(ENV_SDK_DISABLED, "").strip().lower() in _TRUTHY:
        return None
    if env.get(ENV_OTLP_TRACES_ENDPOINT) or env.get(ENV_OTLP_ENDPOINT):
        # Imported here: it pulls in requests/urllib3, which nobody without an endpoint needs.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        if timeout is None and not (env.get(ENV_OTLP_TRACES_TIMEOUT) or env.get(ENV_OTLP_TIMEOUT)):
            timeout = DEFAULT_EXPORT_TIMEOUT
        return OTLPSpanExporter(timeout=timeout)
    if env.get(ENV_CONSOLE, "").strip().lower() in _TRUTHY:
        return ConsoleSpanExporter(service_name=None)
    return None


def build_resource(identity: Identity, service_name: str | None = None) -> Resource:
    """Resource for ``identity``: ours win over OTEL_RESOURCE_ATTRIBUTES, except service.name."""
    attrs: dict[str, Any] = {
        RES_SERVICE_INSTANCE_ID: f"{identity.job}/rank-{identity.rank}",
        RES_JOB: identity.job,
        RES_RANK: identity.rank,
        RES_LOCAL_RANK: identity.local_rank,
        RES_WORLD_SIZE: identity.world_size,
        RES_HOST_NAME: identity.host,
        "telemetry.distro.name": "fsdp-mem-otel",
        "telemetry.distro.version": __version__,
    }
    for key, value in (
        (RES_K8S_POD_NAME, identity.pod),
        (RES_K8S_NAMESPACE_NAME, identity.namespace),
        (RES_K8S_NODE_NAME, identity.node),
        (RES_K8S_POD_UID, identity.pod_uid),
    ):
        if value:
            attrs[key] = value
    if service_name:
        attrs[RES_SERVICE_NAME] = service_name
    resource = Resource.create(attrs)  # merges OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME under ours
    if str(resource.attributes.get(RES_SERVICE_NAME, "")).startswith("unknown_service"):  # the SDK's fallback
        resource = resource.merge(Resource({RES_SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


class _GuardedSpanExporter(SpanExporter):
    """Wraps the real span exporter (on the processor's worker thread): counts failed batches,
    never raises, and after shutdown's deadline drops what is left instead of waiting on a dead
    endpoint once per batch."""

    def __init__(self, inner: SpanExporter, errors: FailureLog) -> None:
        self.inner = inner
        self._errors = errors
        self.drop_after: float | None = None  # time.monotonic() deadline, set by shutdown
        self.exported_spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.drop_after is not None and time.monotonic() > self.drop_after:
            self._errors.failed("shutdown", None, f"dropped {len(spans)} spans still queued at the shutdown deadline")
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # noqa: BLE001 - runs on the SDK's worker thread; count, never raise
            self._errors.failed("sending spans", exc)
            return SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported_spans += len(spans)
            self._errors.recovered("sending spans")
        else:
            self._errors.failed("sending spans", None, f"{type(self.inner).__name__} could not send {len(spans)} spans")
        return result

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception as exc:  # noqa: BLE001
            self._errors.failed("shutdown", exc)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return bool(self.inner.force_flush(timeout_millis))
        except Exception as exc:  # noqa: BLE001
            self._errors.failed("flush", exc)
            return False


@dataclass
class _Call:
    """One forward or backward call of one module: the future span's interval, parent, context
    and events."""

    key: str
    pass_: str
    index: int
    start: int
    end: int
    complete: bool
    depth: int
    parent: _Call | None = None
    context: SpanContext | None = None
    events: list[Event] = field(default_factory=list)


class OTelSpanExporter:
    """StepReports -> OpenTelemetry traces (see the module docstring for the span layout).

    Args:
        identity: who this process is (default: ``Identity.from_env()``); becomes the resource.
        span_exporter: where spans go (default: from the environment, see ``default_span_exporter``;
            None there means the exporter is off).
        spans_every: export step 1 and every Nth step (plus every aborted step); N >= 1.
        module_spans_every: module spans (with their state events) on step 1, every Nth step
            (default 1000) and aborted steps; the other exported steps get the step span only.
            N >= 1.
        service_name: ``service.name``; None (default): OTEL_SERVICE_NAME, else ``service.name`` in
            OTEL_RESOURCE_ATTRIBUTES, else "fsdp-mem-otel". Given, it wins over both.
        export_timeout: seconds one OTLP export request may take (default: the
            OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT variables, else 5); only for the default exporter.
        shutdown_timeout: seconds ``shutdown()`` / ``force_flush()`` wait at most (default
            export_timeout + 2): spans not sent by then are dropped and counted.
        max_queue_size, schedule_delay_millis, max_export_batch_size: BatchSpanProcessor settings
            (default: the SDK's, i.e. the OTEL_BSP_* variables).
        max_pending_steps: reports waiting for the span-building thread; when it falls this far
            behind, new steps are dropped and counted (raise spans_every instead).

    ``export()`` only queues the report: a daemon thread builds the spans, the SDK's batch
    processor thread sends them. It never raises and never waits on the network; failures
    (queueing, building spans, sending them, flushing) are logged once per kind and counted in
    ``errors_total``.
    """

    def __init__(
        self,
        identity: Identity | None = None,
        *,
        span_exporter: SpanExporter | None = None,
        spans_every: int = 1,
        module_spans_every: int = DEFAULT_MODULE_SPANS_EVERY,
        service_name: str | None = None,
        export_timeout: float | None = None,
        shutdown_timeout: float | None = None,
        max_queue_size: int | None = None,
        schedule_delay_millis: float | None = None,
        max_export_batch_size: int | None = None,
        max_pending_steps: int = 64,
        config: OTelConfig | None = None,
    ) -> None:
        if identity is not None and not isinstance(identity, Identity):
            raise TypeError(
                f"identity must be an fsdp_mem_otel.identity.Identity or None; got {type(identity).__name__}"
            )
        if span_exporter is not None and not callable(getattr(span_exporter, "export", None)):
            raise TypeError(
                f"span_exporter must be an OpenTelemetry SpanExporter or None; got {type(span_exporter).__name__}"
            )
        if config is None:
            config = OTelConfig(
                spans_every=spans_every, module_spans_every=module_spans_every, service_name=service_name,
                export_timeout=export_timeout,
                shutdown_timeout=shutdown_timeout, max_queue_size=max_queue_size,
                schedule_delay_millis=schedule_delay_millis, max_export_batch_size=max_export_batch_size,
                max_pending_steps=max_pending_steps)
        elif not isinstance(config, OTelConfig):
            raise TypeError(f"config must be an OTelConfig or None; got {type(config).__name__}")
        self.config = config
        spans_every, service_name, export_timeout = config.spans_every, config.service_name, config.export_timeout
        shutdown_timeout, max_pending_steps = config.shutdown_timeout, config.max_pending_steps
        max_queue_size, max_export_batch_size = config.max_queue_size, config.max_export_batch_size
        schedule_delay_millis = config.schedule_delay_millis
        self.identity = identity if identity is not None else Identity.from_env()
        self.spans_every = spans_every
        self.module_spans_every = config.module_spans_every
        self.resource = build_resource(self.identity, service_name)
        self._errors = FailureLog(logger, "OTel exporter")
        self._shutdown_lock = threading.Lock()
        self._closed = False
        self.steps_exported = 0
        inner = span_exporter if span_exporter is not None else default_span_exporter(timeout=export_timeout)
        self._shutdown_timeout = shutdown_timeout or (export_timeout or DEFAULT_EXPORT_TIMEOUT) + 2.0
        self._guard: _GuardedSpanExporter | None = None
        self._provider: TracerProvider | None = None
        if inner is None:
            return  # off: nothing configured
        self._guard = _GuardedSpanExporter(inner, self._errors)
        # Own provider, never the global one. Not the SDK's atexit hook (it would wait 30 s per
        # batch on a dead collector) but ours, bounded by shutdown_timeout, for owners that never
        # call shutdown() (the tracker's close() does).
        self._provider = TracerProvider(resource=self.resource, shutdown_on_exit=False)
        self._processor = BatchSpanProcessor(
            self._guard,
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_millis,
            max_export_batch_size=max_export_batch_size,
        )
        self._provider.add_span_processor(self._processor)
        # Spans are built off the training thread too (~0.5 ms per module call with encoding,
        # measured): export() only queues the report, which the tracker never touches again.
        self._worker: BackgroundWorker[StepReport] = BackgroundWorker(
            "spans", self._build, self._errors, max_items=max_pending_steps)
        at_exit(self.shutdown)

    # -- state -------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False when no span exporter is configured (export() does nothing)."""
        return self._provider is not None

    @property
    def errors_total(self) -> int:
        """Failures so far: building spans, sending batches, flushing."""
        return self._errors.total

    @property
    def span_exporter(self) -> SpanExporter | None:
        """The exporter spans are sent through (None when off)."""
        return None if self._guard is None else self._guard.inner

    def wants(self, report: StepReport) -> bool:
        """Whether ``report``'s step is exported under ``spans_every``."""
        step = report.step
        return step == 1 or step % self.spans_every == 0 or report.aborted is not None

    def wants_modules(self, report: StepReport) -> bool:
        """Whether ``report``'s module spans go with its step span: step 1, every
        ``module_spans_every``-th step and aborted steps."""
        step = report.step
        return step == 1 or step % self.module_spans_every == 0 or report.aborted is not None

    # -- Exporter protocol -------------------------------------------------------------------
    def export(self, report: StepReport) -> None:
        """Queue ``report`` for the span-building thread: O(1), never raises, never waits."""
        if self._provider is None or self._closed:
            return
        try:
            if not self.wants(report):
                return
            self._worker.submit(report)
        except Exception as exc:  # noqa: BLE001 - telemetry must not break training
            self._errors.failed("queueing", exc)

    def force_flush(self, timeout: float | None = None) -> bool:
        """Build and send what is queued; waits at most ``timeout`` seconds (default shutdown_timeout)."""
        if self._provider is None:
            return True  # off: nothing to send
        if self._closed:
            return False
        provider = self._provider

        def flush() -> bool:
            self._worker.flush()
            return bool(provider.force_flush())

        return self._bounded("flush", flush, timeout)

    def shutdown(self) -> None:
        """Build and send what is queued (at most shutdown_timeout seconds, then drop it), stop both
        threads. Safe to call twice."""
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        if self._provider is None or self._guard is None:
            return
        self._guard.drop_after = time.monotonic() + self._shutdown_timeout
        provider = self._provider

        def stop() -> None:
            self._worker.shutdown(self._shutdown_timeout)
            provider.shutdown()

        self._bounded("shutdown", stop, self._shutdown_timeout + 1.0)

    def _build(self, report: StepReport) -> None:
        """On the worker: one report's spans."""
        self._emit(report)
        self.steps_exported += 1

    def _bounded(self, what: str, fn: Any, timeout: float | None) -> bool:
        """Run ``fn`` on a daemon thread and wait at most ``timeout`` s: the SDK's flush has no
        working timeout of its own (opentelemetry-python#4568) and would wait on a hanging
        collector once per batch."""
        done = threading.Event()
        result: list[bool] = []

        def run() -> None:
            try:
                out = fn()
                result.append(out is not False)
            except Exception as exc:  # noqa: BLE001
                self._errors.failed(what, exc)
                result.append(False)
            finally:
                done.set()

        threading.Thread(target=run, name=f"fsdp-mem-otel-{what}", daemon=True).start()
        if not done.wait(self._shutdown_timeout if timeout is None else timeout):
            self._errors.failed(what, None, f"gave up after {timeout or self._shutdown_timeout:.1f}s; queued spans "
                                "dropped")
            return False
        return bool(result and result[0])

    # -- span building -----------------------------------------------------------------------
    def _emit(self, report: StepReport) -> None:
        provider = self._provider
        assert provider is not None
        start = int(report.start_time_ns) or int(report.end_time_ns) or time.time_ns()
        end = max(int(report.end_time_ns) or time.time_ns(), start)
        with_modules = self.wants_modules(report)
        attributes = _step_attributes(report, self._errors.total)
        attributes[ATTR_MODULE_SPANS] = with_modules
        ids = provider.id_generator
        trace_id = ids.generate_trace_id()
        sampling = provider.sampler.should_sample(None, trace_id, SPAN_STEP, SpanKind.INTERNAL, attributes)
        if not sampling.decision.is_sampled():
            return  # OTEL_TRACES_SAMPLER left this step out: none of its spans is exported
        if sampling.attributes:
            attributes.update(sampling.attributes)
        flags = TraceFlags(TraceFlags.SAMPLED | (_RANDOM_TRACE_ID if ids.is_trace_id_random() else 0))

        def context() -> SpanContext:
            return SpanContext(trace_id, ids.generate_span_id(), is_remote=False, trace_flags=flags,
                               trace_state=sampling.trace_state)

        step_ctx = context()
        step_events: list[Event] = []
        spans: list[ReadableSpan] = []
        if with_modules:
            calls = _calls(report, end)  # sorted so a parent's context exists before its children's
            for call in calls:
                call.context = context()
            self._add_snapshot_events(report, calls, step_events)
            for call in reversed(calls):  # children first, as spans end
                name = f"{SPAN_FORWARD if call.pass_ == PASS_FORWARD else SPAN_BACKWARD} {call.key}"
                attrs: dict[str, Any] = {ATTR_MODULE: call.key, ATTR_PASS: call.pass_, ATTR_CALL: call.index}
                if not call.complete:
                    attrs[ATTR_INCOMPLETE] = True
                peak_state = PEAK_FORWARD if call.pass_ == PASS_FORWARD else PEAK_BACKWARD
                peaks = report.modules[call.key].snapshots.get(peak_state, [])
                if call.index < len(peaks):
                    attrs[_PEAK_ATTRS[TOTAL]] = max((int(c.get(TOTAL, 0)) for c in peaks[call.index].values()),
                                                    default=0)
                parent = call.parent.context if call.parent is not None else step_ctx
                spans.append(ReadableSpan(name, call.context, parent, self.resource, attrs, tuple(call.events),
                                          kind=SpanKind.INTERNAL, start_time=call.start, end_time=call.end,
                                          instrumentation_scope=_SCOPE))
        for dev, cats in report.peak.items():
            step_events.append(Event(EVENT_PEAK, {ATTR_DEVICE: str(dev), **_mem(cats)}, timestamp=end))
        status = _UNSET
        if report.aborted is not None:
            status = Status(StatusCode.ERROR, f"{report.aborted.error}: {report.aborted.message}")
        spans.append(ReadableSpan(SPAN_STEP, step_ctx, None, self.resource, attributes, tuple(step_events),
                                  kind=SpanKind.INTERNAL, status=status, start_time=start, end_time=end,
                                  instrumentation_scope=_SCOPE))
        for span in spans:
            self._processor.on_end(span)

    def _add_snapshot_events(self, report: StepReport, calls: list[_Call], step_events: list[Event]) -> None:
        """Each snapshot becomes an event, in time order, on its own module's span of the same pass
        holding its time; else (activation-checkpoint recompute runs just before the module's
        backward) on the innermost span open at that time, else on the step span; those two carry
        ``fsdp.module`` and ``fsdp.call``."""
        by_key: dict[str, list[_Call]] = {}
        for call in calls:
            by_key.setdefault(call.key, []).append(call)
        fallback_time = int(report.end_time_ns) or time.time_ns()
        order = {state: n for n, state in enumerate(STATES)}
        snapshots: list[tuple[int, int, str, str, int, DeviceBreakdown]] = []
        for key, mod in report.modules.items():
            for state, snaps in mod.snapshots.items():
                times = mod.times.get(state, [])
                for i, breakdown in enumerate(snaps):
                    t = int(times[i]) if i < len(times) else fallback_time
                    snapshots.append((t, order.get(state, len(order)), state, key, i, breakdown))
        snapshots.sort(key=lambda ev: ev[:2])
        for t, _, state, key, i, breakdown in snapshots:
            holder = _containing(by_key.get(key, []), state, t)
            extra: dict[str, Any] = {}
            if holder is None:
                holder = _innermost(calls, t)
                extra = {ATTR_MODULE: key, ATTR_CALL: i}
            target = holder.events if holder is not None else step_events
            for dev, cats in breakdown.items():
                target.append(Event(str(state), {ATTR_DEVICE: str(dev), **_mem(cats), **extra}, timestamp=t))


#: W3C Trace Context level 2's random-trace-id flag, as the SDK's Tracer sets it (newer APIs only)
_RANDOM_TRACE_ID = int(getattr(TraceFlags, "RANDOM_TRACE_ID", 0))


def _step_attributes(report: StepReport, exporter_errors: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        ATTR_STEP: int(report.step),
        ATTR_MODE: str(report.mode),
        ATTR_FSDP_VERSION: int(report.fsdp_version),
        ATTR_ERRORS: int(report.errors_total),
        ATTR_EXPORTER_ERRORS: exporter_errors,
        ATTR_OVERHEAD: float(report.tracker_overhead_seconds),
    }
    if report.peak:
        devices = sorted(report.peak)
        main = max(devices, key=lambda d: report.peak[d].get(TOTAL, 0))
        attrs[ATTR_DEVICE] = str(main)
        attrs[ATTR_DEVICES] = tuple(str(d) for d in devices)
        for cat, value in report.peak[main].items():
            if cat in _PEAK_ATTRS:
                attrs[_PEAK_ATTRS[cat]] = int(value)
    if report.warnings:
        attrs[ATTR_WARNINGS] = tuple(str(w) for w in report.warnings)
    if report.leak is not None:
        attrs[ATTR_LEAK_GROWING] = tuple(sorted(report.leak.growing))
        attrs.update({f"fsdp.leak.{c}.bytes_per_step": float(v) for c, v in report.leak.growing.items()})
        attrs[ATTR_LEAK_HELD] = tuple(report.leak.held)
    if report.aborted is not None:
        a = report.aborted
        attrs.update({ATTR_ABORTED_ERROR: str(a.error), ATTR_ABORTED_OOM: bool(a.oom),
                      ATTR_ABORTED_MODULE: str(a.module), ATTR_ABORTED_STATE: str(a.state)})
    return attrs


def _mem(cats: Mapping[str, int]) -> dict[str, int]:
    return {_MEM_ATTRS[c]: int(v) for c, v in cats.items() if c in _MEM_ATTRS}


def _depth(key: str) -> int:
    return 0 if key == ROOT_KEY else key.count(".") + 1


def _pair(starts: Iterable[int], ends: Iterable[int], fallback_end: int) -> list[tuple[int, int, bool]]:
    """Match each start with the first unused end at or after it; a start left without an end
    (the step aborted mid-call) ends at ``fallback_end`` and is marked incomplete."""
    ends_sorted = sorted(ends)
    out: list[tuple[int, int, bool]] = []
    j = 0
    for s in sorted(starts):
        while j < len(ends_sorted) and ends_sorted[j] < s:
            j += 1
        if j < len(ends_sorted):
            out.append((s, ends_sorted[j], True))
            j += 1
        else:
            out.append((s, max(s, fallback_end), False))
    return out


def _calls(report: StepReport, step_end: int) -> list[_Call]:
    """Every module call of the step, sorted by start (outer first on ties), each with the
    innermost call that was open when it started as its parent (None: the step span)."""
    calls: list[_Call] = []
    for key, mod in report.modules.items():
        for pass_, _, start_state, end_state, _peak in _PASSES:
            pairs = _pair(mod.times_of(start_state), mod.times_of(end_state), step_end)
            for i, (s, e, ok) in enumerate(pairs):
                calls.append(_Call(key, pass_, i, s, e, ok, _depth(key)))
    calls.sort(key=lambda c: (c.start, -c.end, c.depth))
    stack: list[_Call] = []
    for call in calls:
        while stack and stack[-1].end < call.start:
            stack.pop()
        call.parent = stack[-1] if stack else None
        stack.append(call)
    return calls


def _containing(calls: list[_Call], state: str, t: int) -> _Call | None:
    """The call of this module whose span holds time ``t``, preferring the state's own pass."""
    want = PASS_FORWARD if state in _FORWARD_STATES else PASS_BACKWARD if state in _BACKWARD_STATES else None
    fallback: _Call | None = None
    for call in calls:
        if call.start <= t <= call.end:
            if want is None or call.pass_ == want:
                return call
            fallback = fallback or call
    return fallback


def _innermost(calls: list[_Call], t: int) -> _Call | None:
    """The call open at time ``t`` that started last (``calls`` is sorted by start)."""
    found: _Call | None = None
    for call in calls:
        if call.start > t:
            break
        if t <= call.end:
            found = call
    return found
