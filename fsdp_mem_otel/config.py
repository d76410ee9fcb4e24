"""Configuration: one frozen dataclass per component, each validated once, on construction.

``TrackerConfig`` (how to measure) and ``ExportConfig`` (where reports go) are what users set, in
code or through the environment (``from_env``; every variable is listed in ``env.py``).
``ExportConfig`` composes the exporters' own configs, ``PrometheusConfig``, ``JSONLConfig`` and
``OTelConfig``, which the exporters also build from their keyword arguments: whichever way an
exporter is configured, one dataclass checks it. Standard library only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, TypeVar

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
_FALSE = {"0", "false", "no", "off"}
#: ``{rank}`` in a JSONL path is replaced by the rank (``offline.jsonl_format.RANK_PLACEHOLDER``)
RANK_PLACEHOLDER = "{rank}"


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
        """Build from FSDP_MEM_OTEL_* variables (``TRACKER_ENV``); ``overrides`` (from code) win
        over the env. A value that is not accepted raises ``ValueError`` naming the variable, the
        value and what is accepted (``read_env`` is the forgiving reader a launched job uses)."""
        return _from_env(cls, TRACKER_ENV, env, overrides)


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
    """Where StepReports go (see EXPORT_ENV for the environment names).

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
        jsonl: path of the JSON-lines file; ``{rank}`` is replaced by the rank. A path without it in
            a job of several ranks gets the rank before its extension, so that ranks never share a
            file: ``run.jsonl`` -> ``run.rank0.jsonl``, ``run.rank1.jsonl``, ... (``jsonl_path``).
        jsonl_modules_every, jsonl_max_bytes, jsonl_backup_count, jsonl_compress: see ``JSONLConfig``.
        spans_every: OpenTelemetry spans for step 1 and every Nth step (when an OTLP endpoint is set).
        module_spans_every: module spans on step 1, every Nth and aborted steps.
        spans: False: no spans even where the OTEL_* environment sets an endpoint.
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
    spans: bool = True

    def __post_init__(self) -> None:
        # checked under the names users set (the component configs below check the rest)
        check_bool("prometheus", self.prometheus)
        check_int("prometheus_port", self.prometheus_port, 1, 65535)
        check_text("prometheus_addr", self.prometheus_addr)
        check_tls(self.tls_certfile, self.tls_keyfile, self.tls_client_cafile, prefix="tls_")
        check_int("spans_every", self.spans_every, 1)
        check_int("module_spans_every", self.module_spans_every, 1)
        check_bool("spans", self.spans)
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

    def jsonl_path(self, rank: int | str, world_size: int = 1) -> str:
        """The JSON-lines file of ``rank`` in a job of ``world_size`` ranks: ``{rank}`` in ``jsonl``
        filled in; a path without it, with several ranks, gets ``.rank<rank>`` before its extension
        (``run.jsonl`` -> ``run.rank0.jsonl``, the names ``fsdp-mem-otel report`` and the docs use).
        ``rank`` may be text: ``jsonl_path("{0..7}", 8)`` says all of them."""
        if self.jsonl is None:
            raise ValueError("jsonl is not set: no JSON-lines file configured")
        return rank_template(self.jsonl, world_size).replace(RANK_PLACEHOLDER, str(rank))

    def jsonl_config(self, rank: int, world_size: int = 1) -> JSONLConfig:
        """The JSON-lines exporter's part, for ``rank`` of ``world_size`` (its path: ``jsonl_path``)."""
        return JSONLConfig(path=self.jsonl_path(rank, world_size), modules_every=self.jsonl_modules_every,
                           max_bytes=self.jsonl_max_bytes, backup_count=self.jsonl_backup_count,
                           compress=self.jsonl_compress)

    def otel_config(self) -> OTelConfig:
        """The span exporter's part (spans are on when the OTEL_* environment sets an endpoint)."""
        return OTelConfig(spans_every=self.spans_every, module_spans_every=self.module_spans_every)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ExportConfig:
        """Build from FSDP_MEM_OTEL_* exporter variables (``EXPORT_ENV``); ``overrides`` (from
        code) win. A value that is not accepted raises ``ValueError`` naming the variable, the
        value and what is accepted (``read_env`` is the forgiving reader a launched job uses)."""
        return _from_env(cls, EXPORT_ENV, env, overrides)


def rank_template(path: str, world_size: int) -> str:
    """``path`` with a ``{rank}`` where each rank's file differs: as it is if it has one or the job
    has one rank, else ``.rank{rank}`` before its extension (``run.jsonl`` -> ``run.rank{rank}.jsonl``)."""
    if RANK_PLACEHOLDER in path or world_size <= 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{RANK_PLACEHOLDER}{ext}"


# -- the environment -------------------------------------------------------------------------------
# Each variable is read by one ``EnvVar``: what it sets, what it accepts (said in every message
# about it) and what a job does when its value is not accepted. Two readers share them:
# ``TrackerConfig.from_env`` / ``ExportConfig.from_env`` (the direct API) raise ``ValueError`` for
# the first bad value; ``read_env`` (what ``fsdp_mem_otel.run``, its bootstrap and the framework
# callbacks use) never raises: a bad value switches off only the part it configures (``off``) or,
# where that part is the whole tracker's way of measuring, the field keeps its default.

#: what a bad value switches off (``EnvVar.off``), as messages say it
TRACKING_OFF = "tracking off, training goes on untracked"
ENDPOINT_OFF = "Prometheus endpoint off, the rest of tracking goes on"
SIDECAR_OFF = "sidecar file off, the rest of tracking goes on"
JSONL_OFF = "JSONL off, the rest of tracking goes on"
SPANS_OFF = "spans off, the rest of tracking goes on"
_SWITCH = "1/0, true/false, yes/no, on/off"


@dataclass(frozen=True)
class EnvVar:
    """How one environment variable is read.

    Attributes:
        field: the config field it sets.
        accepted: what it accepts, in words (every message about a bad value says it).
        parse: text -> value; raises ``ValueError`` for a value that is not accepted.
        off: what a bad value switches off in a launched job (``read_env``; one of ``TRACKING_OFF``,
            ``ENDPOINT_OFF``, ``SIDECAR_OFF``, ``JSONL_OFF``, ``SPANS_OFF``); None: the field keeps
            its default.
    """

    field: str
    accepted: str
    parse: Callable[[str], object]
    off: str | None = None


@dataclass(frozen=True)
class BadSetting:
    """An environment variable whose value is not accepted (or that is missing: ``raw`` None).
    ``str()`` is what the direct API raises; ``line()`` what a launched job logs, once."""

    var: str
    raw: str | None
    accepted: str
    outcome: str  # what a launched job does instead

    def __str__(self) -> str:
        if self.raw is None:
            return f"{self.var} is not set ({self.accepted})"
        return f"{self.var}={self.raw!r} is not accepted ({self.accepted})"

    def line(self) -> str:
        return f"fsdp_mem_otel: {self}: {self.outcome}"


class EnvSettings(NamedTuple):
    """What ``read_env`` found: the configs a launched job runs with, whether it is quiet
    (``FSDP_MEM_OTEL_QUIET``), and each variable whose value was not accepted."""

    tracker: TrackerConfig
    export: ExportConfig
    quiet: bool
    bad: tuple[BadSetting, ...]


def _switch(auto: bool = False) -> Callable[[str], object]:
    def parse(raw: str) -> object:
        low = raw.strip().lower()
        if auto and low == "auto":
            return None
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ValueError(raw)
    return parse


def _word(*choices: str) -> Callable[[str], object]:
    def parse(raw: str) -> object:
        low = raw.strip().lower()
        if low not in choices:
            raise ValueError(raw)
        return low
    return parse


def _whole(minimum: int, maximum: int | None = None) -> Callable[[str], object]:
    def parse(raw: str) -> object:
        return check_int("value", int(raw.strip()), minimum, maximum)
    return parse


def _seconds(raw: str) -> object:
    value = float(raw.strip())
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(raw)
    return value


def _text(raw: str) -> object:
    return raw.strip()


def _file(raw: str) -> object:
    path = raw.strip()
    if not os.path.isfile(path):
        raise ValueError(raw)
    return path


#: TrackerConfig's environment: variable -> how it is read
TRACKER_ENV = {
    env.FSDP_MEM_OTEL_MODE: EnvVar("mode", " or ".join(MODES), _word(*MODES)),
    env.FSDP_MEM_OTEL_DEEP_EVERY: EnvVar("deep_every", "a whole number of steps >= 0; 0: never", _whole(0)),
    env.FSDP_MEM_OTEL_MAX_ERRORS: EnvVar("max_errors", "a whole number >= 0; 0: never detach", _whole(0)),
    env.FSDP_MEM_OTEL_ENABLED: EnvVar("enabled", _SWITCH, _switch(), TRACKING_OFF),
    env.FSDP_MEM_OTEL_RESET_PEAKS: EnvVar("reset_peaks", _SWITCH + " or auto", _switch(auto=True)),
    env.FSDP_MEM_OTEL_ACTIVATIONS: EnvVar("activations", _SWITCH, _switch()),
    env.FSDP_MEM_OTEL_DEEP_WHEN_COMPILED: EnvVar("deep_when_compiled", " or ".join(DEEP_WHEN_COMPILED),
                                                 _word(*DEEP_WHEN_COMPILED)),
    env.FSDP_MEM_OTEL_LEAK_WINDOW: EnvVar("leak_window", "a whole number of steps >= 10", _whole(10)),
}
_STEPS = "a whole number of steps >= 1"
#: ExportConfig's environment: variable -> how it is read. OpenTelemetry's own OTEL_* variables
#: (endpoint, headers, service name, resource attributes) are read by the OpenTelemetry SDK: spans
#: are on when OTEL_EXPORTER_OTLP_ENDPOINT is set.
EXPORT_ENV = {
    env.FSDP_MEM_OTEL_PROMETHEUS: EnvVar("prometheus", _SWITCH, _switch(), ENDPOINT_OFF),
    env.FSDP_MEM_OTEL_PROMETHEUS_PORT: EnvVar(
        "prometheus_port", "a port in 1..65535, the first rank's; each rank serves it + LOCAL_RANK",
        _whole(1, 65535), ENDPOINT_OFF),
    env.FSDP_MEM_OTEL_PROMETHEUS_ADDR: EnvVar("prometheus_addr", "an address to listen on, e.g. 0.0.0.0", _text,
                                              ENDPOINT_OFF),
    env.FSDP_MEM_OTEL_TLS_CERTFILE: EnvVar("tls_certfile", "the path of an existing PEM file", _file, ENDPOINT_OFF),
    env.FSDP_MEM_OTEL_TLS_KEYFILE: EnvVar("tls_keyfile", "the path of an existing PEM file", _file, ENDPOINT_OFF),
    env.FSDP_MEM_OTEL_TLS_CLIENT_CAFILE: EnvVar("tls_client_cafile", "the path of an existing PEM file", _file,
                                                ENDPOINT_OFF),
    env.FSDP_MEM_OTEL_DETAIL: EnvVar("detail", _SWITCH, _switch()),
    env.FSDP_MEM_OTEL_DETAIL_TOP_K: EnvVar("detail_top_k", "a whole number of modules >= 1", _whole(1)),
    env.FSDP_MEM_OTEL_ESTIMATE: EnvVar("estimate", "a file fsdp-mem-otel estimate wrote", _text),
    env.FSDP_MEM_OTEL_SIDECAR_DIR: EnvVar("sidecar_dir", "a folder", _text, SIDECAR_OFF),
    env.FSDP_MEM_OTEL_SIDECAR_INTERVAL: EnvVar("sidecar_interval_seconds",
                                               "a number of seconds >= 0, e.g. 15; 0: every step", _seconds,
                                               SIDECAR_OFF),
    env.FSDP_MEM_OTEL_JSONL: EnvVar("jsonl", "a file path; {rank} is filled in", _text, JSONL_OFF),
    env.FSDP_MEM_OTEL_JSONL_MODULES_EVERY: EnvVar("jsonl_modules_every", _STEPS, _whole(1), JSONL_OFF),
    env.FSDP_MEM_OTEL_JSONL_MAX_BYTES: EnvVar(
        "jsonl_max_bytes", "a whole number of bytes, e.g. 1073741824; 0: never rotate", _whole(0), JSONL_OFF),
    env.FSDP_MEM_OTEL_JSONL_BACKUP_COUNT: EnvVar("jsonl_backup_count", "a whole number of files >= 0", _whole(0),
                                                 JSONL_OFF),
    env.FSDP_MEM_OTEL_JSONL_COMPRESS: EnvVar("jsonl_compress", _SWITCH, _switch(), JSONL_OFF),
    env.FSDP_MEM_OTEL_SPANS_EVERY: EnvVar("spans_every", _STEPS, _whole(1), SPANS_OFF),
    env.FSDP_MEM_OTEL_MODULE_SPANS_EVERY: EnvVar("module_spans_every", _STEPS, _whole(1), SPANS_OFF),
}
_QUIET = EnvVar("quiet", _SWITCH, _switch())  # read_env only: what the launcher says
_TLS = (env.FSDP_MEM_OTEL_TLS_CERTFILE, env.FSDP_MEM_OTEL_TLS_KEYFILE, env.FSDP_MEM_OTEL_TLS_CLIENT_CAFILE)


def _default_text(value: object) -> str:
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _read(cls: type, table: Mapping[str, EnvVar], environ: Mapping[str, str]) -> tuple[dict[str, Any],
                                                                                     list[BadSetting]]:
    """The fields ``table``'s variables set in ``environ`` (unset or blank: not set), and those whose
    value is not accepted (left out of the fields)."""
    values: dict[str, Any] = {}
    bad: list[BadSetting] = []
    for var, spec in table.items():
        raw = environ.get(var)
        if raw is None or not raw.strip():
            continue
        try:
            values[spec.field] = spec.parse(raw)
        except (TypeError, ValueError):
            outcome = spec.off or f"using the default ({_default_text(getattr(cls, spec.field))})"
            bad.append(BadSetting(var, raw, spec.accepted, outcome))
    return values, bad


def _tls_pairs(values: Mapping[str, object]) -> list[BadSetting]:
    """TLS comes as certificate and key (both or neither), a client CA only with them."""
    cert, key, ca = _TLS
    have = {name: values.get(EXPORT_ENV[name].field) is not None for name in _TLS}
    if have[cert] and not have[key]:
        return [BadSetting(key, None, f"{cert} needs it: set both for HTTPS, or neither", ENDPOINT_OFF)]
    if have[key] and not have[cert]:
        return [BadSetting(cert, None, f"{key} needs it: set both for HTTPS, or neither", ENDPOINT_OFF)]
    if have[ca] and not have[cert]:
        return [BadSetting(cert, None, f"{ca} (mutual TLS) needs it and {key}", ENDPOINT_OFF)]
    return []


def _from_env(cls: type[_C], table: Mapping[str, EnvVar], environ: Mapping[str, str] | None,
              overrides: Mapping[str, object]) -> _C:
    values, bad = _read(cls, table, os.environ if environ is None else environ)
    if table is EXPORT_ENV and not bad:
        bad = _tls_pairs(values)
    if bad:
        raise ValueError(str(bad[0]))
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    for name, value in overrides.items():
        if name not in known:
            raise TypeError(f"unknown config field {name!r}; accepted: {', '.join(sorted(known))}")
        values[name] = value
    return cls(**values)


def read_env(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """The configuration the environment asks for, as a launched job runs with it; never raises
    for a value. A variable whose value is not accepted (case aside: ``Deep``, ``LIGHT``,
    ``Auto``, ``True`` are) switches off only what it configures: a bad ``FSDP_MEM_OTEL_JSONL_*``
    the JSONL file, ``FSDP_MEM_OTEL_SIDECAR_*`` the sidecar file, ``FSDP_MEM_OTEL_PROMETHEUS*``
    or ``FSDP_MEM_OTEL_TLS_*`` the endpoint, ``FSDP_MEM_OTEL_*SPANS_EVERY`` the spans,
    ``FSDP_MEM_OTEL_ENABLED`` the tracking; any other (``MODE``, ``DEEP_EVERY``, ``DETAIL``, ...)
    keeps its default. Each is in ``bad``, for the caller to say once."""
    environ = os.environ if environ is None else environ
    tracker_values, bad = _read(TrackerConfig, TRACKER_ENV, environ)
    if any(b.outcome == TRACKING_OFF for b in bad):
        tracker_values["enabled"] = False
    export_values, export_bad = _read(ExportConfig, EXPORT_ENV, environ)
    export_bad += _tls_pairs(export_values)
    offs = {b.outcome for b in export_bad}
    if ENDPOINT_OFF in offs:
        export_values["prometheus"] = False
        for name in _TLS:
            export_values.pop(EXPORT_ENV[name].field, None)
    if SIDECAR_OFF in offs:
        export_values["sidecar_dir"] = None
    if JSONL_OFF in offs:
        export_values["jsonl"] = None
    if SPANS_OFF in offs:
        export_values["spans"] = False
    raw_quiet = environ.get(env.FSDP_MEM_OTEL_QUIET, "")
    quiet, quiet_bad = False, []
    if raw_quiet.strip():
        try:
            quiet = bool(_QUIET.parse(raw_quiet))
        except ValueError:
            quiet_bad.append(BadSetting(env.FSDP_MEM_OTEL_QUIET, raw_quiet, _QUIET.accepted, "not quiet"))
    tracker = TrackerConfig(**tracker_values)
    if not tracker.enabled:  # nothing is exported: what the exporters' variables say does not matter
        export_bad = []
    return EnvSettings(tracker, ExportConfig(**export_values), quiet, tuple(bad + export_bad + quiet_bad))
