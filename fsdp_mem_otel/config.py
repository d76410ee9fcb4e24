"""Configuration: one frozen dataclass per component, each validated once, on construction.

``TrackerConfig`` (how to measure) and ``ExportConfig`` (where reports go) are what users set, in
code or through the environment (``from_env``; every variable is listed in ``env.py``).
``ExportConfig`` composes the exporters' own configs, ``PrometheusConfig``, ``JSONLConfig`` and
``OTelConfig``, which the exporters also build from their keyword arguments: whichever way an
exporter is configured, one dataclass checks it. Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TypeVar

from fsdp_mem_otel import env
from fsdp_mem_otel.checks import (
    check_bool,
    check_int,
    check_optional_int,
    check_path,
    check_seconds,
    check_text,
    check_tls,
)
from fsdp_mem_otel.schema import MODES

#: modules with Prometheus detail series by default (detail=True): the largest peaks first
DEFAULT_DETAIL_TOP_K = 8

#: TrackerConfig's environment: variable -> field
_ENV_FIELDS = {
    env.FSDP_MEM_OTEL_MODE: "mode",
    env.FSDP_MEM_OTEL_DEEP_EVERY: "deep_every",
    env.FSDP_MEM_OTEL_MAX_ERRORS: "max_errors",
    env.FSDP_MEM_OTEL_ENABLED: "enabled",
    env.FSDP_MEM_OTEL_RESET_PEAKS: "reset_peaks",
    env.FSDP_MEM_OTEL_ACTIVATIONS: "activations",
    env.FSDP_MEM_OTEL_DEEP_WHEN_COMPILED: "deep_when_compiled",
    env.FSDP_MEM_OTEL_LEAK_WINDOW: "leak_window",
}
#: What a deep step does on a model with torch.compile'd regions.
DEEP_WHEN_COMPILED = ("skip", "eager")
#: The per-rank Prometheus endpoint's first port (a rank serves DEFAULT_BASE_PORT + LOCAL_RANK).
DEFAULT_BASE_PORT = 9400
#: module spans on one step in 1000 (plus step 1 and aborted steps): at 100 FSDP modules a step
#: with module spans is ~200 spans, ~0.5 MB of OTLP and ~100 ms of background CPU to build and
#: encode, so one in 1000 keeps their share near 0.1 ms per step (benchmarks/exporter_cpu.py);
#: the step span (step-level breakdown) goes every exported step
DEFAULT_MODULE_SPANS_EVERY = 1000
#: seconds between sidecar file rewrites at most: rendering costs ~2.6 ms at 100 modules, and
#: Prometheus reads the file once per scrape interval (30 s in the shipped PodMonitor), not every
#: step: half of it, so each scrape reads a step at most 15 s older than the newest
DEFAULT_SIDECAR_INTERVAL = 15.0
#: JSONL lines carry module snapshots on step 1, one step in 100, deep and aborted steps, and
#: when a module's peak moved by more than 5% (and 64 KiB): a line with them is ~3 KB per module,
#: one without ~2 KB, so at 100 modules the average stays near 5 KB per step
DEFAULT_JSONL_MODULES_EVERY = 100
DEFAULT_JSONL_MODULES_CHANGE = 0.05
_C = TypeVar("_C")
_TRUE = {"1", "true", "yes", "on"}
#: bool fields whose default None means "decided at runtime" (``auto`` in the environment)
_AUTO_BOOLS = {"reset_peaks"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class TrackerConfig:
    """How the tracker measures.

    Attributes:
        mode: "light" (snapshots at FSDP hook boundaries only; the always-on default) or "deep"
            (every op accounted through a dispatch mode).
        deep_every: with mode="light", run every Nth step (steps N, 2N, ...) deep; 0 = never.
        max_errors: after this many internal errors the tracker detaches itself; 0 = never.
        enabled: False makes attach() a no-op (for switching off by environment).
        reset_peaks: on CUDA, the tracker owns the allocator's peak counters: it reads and
            resets them at every module window's edges and at the step end, reports the
            allocator's exact per-step peaks, and adds to each window's and the step's ``temp``
            what the allocator held beyond the tracked tensors (op temporaries light mode does
            not see; ``allocator_temps.py``), about 12 us per edge. The training script's own
            peak statistics (``torch.cuda.max_memory_allocated``, ``memory_stats()``'s
            ``*.peak``, ``torch.accelerator.max_memory_*``) and its resets keep working as
            without the tracker (``shadow_peaks.py``). None (default): on where CUDA is
            available; False (``FSDP_MEM_OTEL_RESET_PEAKS=0``): the counters are never touched
            and the allocator's peaks are sampled at FSDP hooks, missing what lies between two.
        activations: light mode accounts the tensors autograd saves for backward during FSDP
            forwards as ``activation`` (saved-tensor hooks; see activations.py). Turn off for
            models that call ``torch.func`` transforms inside an FSDP module's forward.
        deep_when_compiled: a deep step on a model with ``torch.compile``'d regions: "skip"
            (default: the step stays light, compiled code keeps running compiled, and the report
            says why) or "eager" (the step runs with compilation switched off, so deep mode sees
            every op; the numerics of that step are then eager ones).
        leak_window: step ends the leak detector keeps (>= 10): a category whose live bytes at
            the step end never fell over them and rose at 5 or more of them, and at half or more,
            is reported as growing (``StepReport.leak``), from the 10th step end on.
    """

    mode: str = "light"
    deep_every: int = 0
    max_errors: int = 100
    enabled: bool = True
    reset_peaks: bool | None = None
    activations: bool = True
    deep_when_compiled: str = "skip"
    leak_window: int = 30

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.deep_when_compiled not in DEEP_WHEN_COMPILED:
            raise ValueError(
                f"deep_when_compiled must be one of {', '.join(DEEP_WHEN_COMPILED)}; got {self.deep_when_compiled!r}"
            )
        check_int("deep_every", self.deep_every)
        check_int("max_errors", self.max_errors)
        check_int("leak_window", self.leak_window, 10)
        for name in ("enabled", "activations"):
            check_bool(name, getattr(self, name))
        if self.reset_peaks is not None and not isinstance(self.reset_peaks, bool):
            raise TypeError("reset_peaks must be a bool or None (None: on where CUDA is available); got "
                            f"{type(self.reset_peaks).__name__} {self.reset_peaks!r}")

    def is_deep(self, step: int) -> bool:
        """Whether 1-based step ``step`` runs in deep mode."""
        if self.mode == "deep":
            return True
        return self.deep_every > 0 and step % self.deep_every == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> TrackerConfig:
        """Build from FSDP_MEM_OTEL_* variables; ``overrides`` (from code) win over the env."""
        return _from_env(cls, _ENV_FIELDS, env, overrides)


#: ExportConfig's environment: variable -> field. OpenTelemetry's own OTEL_* variables (endpoint,
#: headers, service name, resource attributes) are read by the OpenTelemetry SDK: spans are on when
#: OTEL_EXPORTER_OTLP_ENDPOINT is set.
EXPORT_ENV_FIELDS = {
    env.FSDP_MEM_OTEL_PROMETHEUS: "prometheus",
    env.FSDP_MEM_OTEL_PROMETHEUS_PORT: "prometheus_port",
    env.FSDP_MEM_OTEL_PROMETHEUS_ADDR: "prometheus_addr",
    env.FSDP_MEM_OTEL_TLS_CERTFILE: "tls_certfile",
    env.FSDP_MEM_OTEL_TLS_KEYFILE: "tls_keyfile",
    env.FSDP_MEM_OTEL_TLS_CLIENT_CAFILE: "tls_client_cafile",
    env.FSDP_MEM_OTEL_DETAIL: "detail",
    env.FSDP_MEM_OTEL_DETAIL_TOP_K: "detail_top_k",
    env.FSDP_MEM_OTEL_ESTIMATE: "estimate",
    env.FSDP_MEM_OTEL_SIDECAR_DIR: "sidecar_dir",
    env.FSDP_MEM_OTEL_SIDECAR_INTERVAL: "sidecar_interval_seconds",
    env.FSDP_MEM_OTEL_JSONL: "jsonl",
    env.FSDP_MEM_OTEL_JSONL_MODULES_EVERY: "jsonl_modules_every",
    env.FSDP_MEM_OTEL_JSONL_MAX_BYTES: "jsonl_max_bytes",
    env.FSDP_MEM_OTEL_JSONL_BACKUP_COUNT: "jsonl_backup_count",
    env.FSDP_MEM_OTEL_JSONL_COMPRESS: "jsonl_compress",
    env.FSDP_MEM_OTEL_SPANS_EVERY: "spans_every",
    env.FSDP_MEM_OTEL_MODULE_SPANS_EVERY: "module_spans_every",
}


@dataclass(frozen=True)
class PrometheusConfig:
    """The per-rank endpoint and sidecar file (``PrometheusExporter``).

    Attributes:
        http: serve ``/metrics`` over HTTP(S); False for sidecar-only export.
        port: serve on exactly this port (0: any free one); None: ``base_port + LOCAL_RANK``.
        base_port: first port of a node's ranks.
        addr: bind address.
        certfile, keyfile: HTTPS with this certificate and key (both or neither).
        client_cafile: with them, require client certificates signed by this CA (mutual TLS).
        detail: also export module x state x device x category bytes (many series; opt-in).
        detail_top_k: with ``detail``, only the K modules with the largest peaks get them.
        sidecar_dir: also write each step's exposition to ``<sidecar_dir>/rank-<rank>.prom``.
        estimate: JSONL from ``fsdp-mem-otel estimate``, exported beside the measured figures.
        heartbeat_seconds: refresh the sidecar file's time this often between steps.
        sidecar_interval_seconds: rewrite the sidecar file at most this often (0: every step).
    """

    http: bool = True
    port: int | None = None
    base_port: int = DEFAULT_BASE_PORT
    addr: str = "0.0.0.0"
    certfile: str | None = None
    keyfile: str | None = None
    client_cafile: str | None = None
    detail: bool = False
    detail_top_k: int = DEFAULT_DETAIL_TOP_K
    sidecar_dir: str | None = None
    estimate: str | None = None
    heartbeat_seconds: float = 10.0
    sidecar_interval_seconds: float = DEFAULT_SIDECAR_INTERVAL

    def __post_init__(self) -> None:
        check_bool("http", self.http)
        check_optional_int("port", self.port, 0, 65535)
        check_int("base_port", self.base_port, 1, 65535)
        check_text("addr", self.addr)
        check_tls(self.certfile, self.keyfile, self.client_cafile, must_exist=False)
        check_bool("detail", self.detail)
        check_int("detail_top_k", self.detail_top_k, 1)
        check_text("estimate", self.estimate, optional=True)
        if self.sidecar_dir is not None and not isinstance(self.sidecar_dir, str | os.PathLike):
            raise TypeError(f"sidecar_dir must be a directory path or None; got {type(self.sidecar_dir).__name__}")
        check_seconds("heartbeat_seconds", self.heartbeat_seconds)
        check_seconds("sidecar_interval_seconds", self.sidecar_interval_seconds, zero=True)


@dataclass(frozen=True)
class JSONLConfig:
    """The JSON-lines file (``JSONLExporter``); see its docstring for each field.

    ``modules_every`` / ``modules_change``: the budget of module snapshots (see the exporter)."""

    path: str
    max_bytes: int = 256 * 1024 * 1024
    backup_count: int = 5
    max_queue: int = 1000
    max_queue_bytes: int = 64 * 1024 * 1024
    index: bool = True
    compress: bool = True
    modules_every: int = DEFAULT_JSONL_MODULES_EVERY
    modules_change: float = DEFAULT_JSONL_MODULES_CHANGE

    def __post_init__(self) -> None:
        check_path("path", self.path)
        check_int("max_bytes", self.max_bytes)
        check_int("backup_count", self.backup_count)
        check_int("max_queue", self.max_queue, 1)
        check_int("max_queue_bytes", self.max_queue_bytes, 1)
        check_bool("index", self.index)
        check_bool("compress", self.compress)
        check_int("modules_every", self.modules_every, 1)
        if isinstance(self.modules_change, bool) or not isinstance(self.modules_change, int | float) \
                or not self.modules_change >= 0:
            raise ValueError(f"modules_change must be a ratio >= 0 (0.05: 5%); got {self.modules_change!r}")


@dataclass(frozen=True)
class OTelConfig:
    """OpenTelemetry spans (``OTelSpanExporter``); see its docstring for each field."""

    spans_every: int = 1
    module_spans_every: int = DEFAULT_MODULE_SPANS_EVERY
    service_name: str | None = None
    export_timeout: float | None = None
    shutdown_timeout: float | None = None
    max_queue_size: int | None = None
    schedule_delay_millis: float | None = None
    max_export_batch_size: int | None = None
    max_pending_steps: int = 64

    def __post_init__(self) -> None:
        check_int("spans_every", self.spans_every, 1)
        check_int("module_spans_every", self.module_spans_every, 1)
        check_text("service_name", self.service_name, optional=True)
        check_seconds("export_timeout", self.export_timeout, optional=True)
        check_seconds("shutdown_timeout", self.shutdown_timeout, optional=True)
        check_optional_int("max_queue_size", self.max_queue_size, 1)
        check_optional_int("max_export_batch_size", self.max_export_batch_size, 1)
        check_int("max_pending_steps", self.max_pending_steps, 1)


@dataclass(frozen=True)
class ExportConfig:
    """Where StepReports go (see EXPORT_ENV_FIELDS for the environment names).

    Attributes:
        prometheus: serve /metrics on ``prometheus_port + LOCAL_RANK``.
        prometheus_port: first port (1-65535).
        prometheus_addr: bind address.
        tls_certfile, tls_keyfile: HTTPS for the endpoint (both or neither).
        tls_client_cafile: with TLS, require client certificates signed by this CA.
        detail: also export module x state x category bytes.
        detail_top_k: with ``detail``, the K modules with the largest peaks get them.
        estimate: JSONL from ``fsdp-mem-otel estimate``, exported beside the measured figures.
        sidecar_dir: write each step's exposition to ``<dir>/rank-<rank>.prom``.
        sidecar_interval_seconds: at most this often (the newest step; 0: every step).
        jsonl: path of the JSON-lines file; ``{rank}`` is replaced by the rank.
        jsonl_modules_every, jsonl_max_bytes, jsonl_backup_count, jsonl_compress: see ``JSONLConfig``.
        spans_every: OpenTelemetry spans for step 1 and every Nth step (when an OTLP endpoint is set).
        module_spans_every: module spans on step 1, every Nth and aborted steps.
    """

    prometheus: bool = True
    prometheus_port: int = DEFAULT_BASE_PORT
    prometheus_addr: str = "0.0.0.0"
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    tls_client_cafile: str | None = None
    detail: bool = False
    detail_top_k: int = DEFAULT_DETAIL_TOP_K
    sidecar_dir: str | None = None
    sidecar_interval_seconds: float = DEFAULT_SIDECAR_INTERVAL
    estimate: str | None = None
    jsonl: str | None = None
    jsonl_modules_every: int = DEFAULT_JSONL_MODULES_EVERY
    jsonl_max_bytes: int = 256 * 1024 * 1024
    jsonl_backup_count: int = 5
    jsonl_compress: bool = True
    spans_every: int = 1
    module_spans_every: int = DEFAULT_MODULE_SPANS_EVERY

    def __post_init__(self) -> None:
        # checked under the names users set (the component configs below check the rest)
        check_bool("prometheus", self.prometheus)
        check_int("prometheus_port", self.prometheus_port, 1, 65535)
        check_text("prometheus_addr", self.prometheus_addr)
        check_tls(self.tls_certfile, self.tls_keyfile, self.tls_client_cafile, prefix="tls_")
        check_int("spans_every", self.spans_every, 1)
        check_int("module_spans_every", self.module_spans_every, 1)
        self.prometheus_config()
        if self.jsonl is not None:
            self.jsonl_config(0)

    def prometheus_config(self) -> PrometheusConfig:
        """The Prometheus exporter's part (HTTP when ``prometheus``, sidecar when ``sidecar_dir``)."""
        return PrometheusConfig(
            http=self.prometheus, base_port=self.prometheus_port, addr=self.prometheus_addr,
            certfile=self.tls_certfile, keyfile=self.tls_keyfile, client_cafile=self.tls_client_cafile,
            detail=self.detail, detail_top_k=self.detail_top_k, sidecar_dir=self.sidecar_dir,
            estimate=self.estimate, sidecar_interval_seconds=self.sidecar_interval_seconds,
        )

    def jsonl_config(self, rank: int) -> JSONLConfig:
        """The JSON-lines exporter's part, for ``rank`` (``{rank}`` in the path filled in)."""
        if self.jsonl is None:
            raise ValueError("jsonl is not set: no JSON-lines file configured")
        return JSONLConfig(path=self.jsonl.replace("{rank}", str(rank)), modules_every=self.jsonl_modules_every,
                           max_bytes=self.jsonl_max_bytes, backup_count=self.jsonl_backup_count,
                           compress=self.jsonl_compress)

    def otel_config(self) -> OTelConfig:
        """The span exporter's part (spans are on when the OTEL_* environment sets an endpoint)."""
        return OTelConfig(spans_every=self.spans_every, module_spans_every=self.module_spans_every)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ExportConfig:
        """Build from FSDP_MEM_OTEL_* exporter variables; ``overrides`` (from code) win."""
        return _from_env(cls, EXPORT_ENV_FIELDS, env, overrides)


def _from_env(cls: type[_C], mapping: Mapping[str, str], env: Mapping[str, str] | None,
              overrides: Mapping[str, object]) -> _C:
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for var, name in mapping.items():
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        values[name] = _parse(cls, var, name, raw)
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    for name, value in overrides.items():
        if name not in known:
            raise TypeError(f"unknown config field {name!r}; accepted: {', '.join(sorted(known))}")
        values[name] = value
    return cls(**values)


def _parse(cls: type, var: str, name: str, raw: str) -> object:
    default = getattr(cls, name)
    if name in _AUTO_BOOLS and raw.strip().lower() == "auto":
        return None
    if isinstance(default, bool) or name in _AUTO_BOOLS:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        auto = "/auto" if name in _AUTO_BOOLS else ""
        raise ValueError(f"{var} must be one of 1/0/true/false/yes/no/on/off{auto}; got {raw!r}")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{var} must be an integer; got {raw!r}") from None
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{var} must be a number; got {raw!r}") from None
    return raw.strip()
