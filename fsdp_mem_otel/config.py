"""Tracker configuration: one dataclass, validated on construction, readable from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TypeVar

from fsdp_mem_otel.model import MODES

#: Environment variables read by TrackerConfig.from_env(); each maps to the field of that name.
ENV_MODE = "FSDP_MEM_OTEL_MODE"  # "light" (default) or "deep"
ENV_DEEP_EVERY = "FSDP_MEM_OTEL_DEEP_EVERY"  # run every Nth step deep; 0 = never
ENV_MAX_ERRORS = "FSDP_MEM_OTEL_MAX_ERRORS"  # disable the tracker after this many internal errors
ENV_ENABLED = "FSDP_MEM_OTEL_ENABLED"  # "0"/"false" turns the tracker into a no-op
ENV_RESET_PEAKS = "FSDP_MEM_OTEL_RESET_PEAKS"  # "1": reset the CUDA allocator's peak counters each step
ENV_ACTIVATIONS = "FSDP_MEM_OTEL_ACTIVATIONS"  # "0": light mode does not account saved activations
ENV_DEEP_WHEN_COMPILED = "FSDP_MEM_OTEL_DEEP_WHEN_COMPILED"  # "skip" (default) or "eager"

_ENV_FIELDS = {
    ENV_MODE: "mode",
    ENV_DEEP_EVERY: "deep_every",
    ENV_MAX_ERRORS: "max_errors",
    ENV_ENABLED: "enabled",
    ENV_RESET_PEAKS: "reset_peaks",
    ENV_ACTIVATIONS: "activations",
    ENV_DEEP_WHEN_COMPILED: "deep_when_compiled",
}
#: What a deep step does on a model with torch.compile'd regions.
DEEP_WHEN_COMPILED = ("skip", "eager")
_C = TypeVar("_C")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass
class TrackerConfig:
    """How the tracker measures.

    Attributes:
        mode: "light" (snapshots at FSDP hook boundaries only; the always-on default) or "deep"
            (every op accounted through a dispatch mode).
        deep_every: with mode="light", run every Nth step (steps N, 2N, ...) deep; 0 = never.
        max_errors: after this many internal errors the tracker detaches itself; 0 = never.
        enabled: False makes attach() a no-op (for switching off by environment).
        reset_peaks: on CUDA, reset the allocator's peak counters at every step end to report its
            exact per-step peaks. Off by default: the tracker never touches the user's peaks and
            reports the maxima it sampled at FSDP hooks instead.
        activations: light mode accounts the tensors autograd saves for backward during FSDP
            forwards as ``activation`` (saved-tensor hooks; see activations.py). Turn off for
            models that call ``torch.func`` transforms inside an FSDP module's forward.
        deep_when_compiled: a deep step on a model with ``torch.compile``'d regions: "skip"
            (default: the step stays light, compiled code keeps running compiled, and the report
            says why) or "eager" (the step runs with compilation switched off, so deep mode sees
            every op; the numerics of that step are then eager ones).
    """

    mode: str = "light"
    deep_every: int = 0
    max_errors: int = 100
    enabled: bool = True
    reset_peaks: bool = False
    activations: bool = True
    deep_when_compiled: str = "skip"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.deep_when_compiled not in DEEP_WHEN_COMPILED:
            raise ValueError(
                f"deep_when_compiled must be one of {', '.join(DEEP_WHEN_COMPILED)}; got {self.deep_when_compiled!r}"
            )
        for name in ("deep_every", "max_errors"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int >= 0; got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be an int >= 0; got {value}")
        for name in ("enabled", "reset_peaks", "activations"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {type(getattr(self, name)).__name__}")

    def is_deep(self, step: int) -> bool:
        """Whether 1-based step ``step`` runs in deep mode."""
        if self.mode == "deep":
            return True
        return self.deep_every > 0 and step % self.deep_every == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> TrackerConfig:
        """Build from FSDP_MEM_OTEL_* variables; ``overrides`` (from code) win over the env."""
        return _from_env(cls, _ENV_FIELDS, env, overrides)


#: Exporter environment variables read by ExportConfig.from_env(); each maps to the field of that name.
#: OpenTelemetry's own OTEL_* variables (endpoint, headers, service name, resource attributes) are
#: read by the OpenTelemetry SDK: spans are on when OTEL_EXPORTER_OTLP_ENDPOINT is set.
EXPORT_ENV_FIELDS = {
    "FSDP_MEM_OTEL_PROMETHEUS": "prometheus",  # per-rank /metrics endpoint on/off (default on)
    "FSDP_MEM_OTEL_PROMETHEUS_PORT": "prometheus_port",  # base port; rank serves base + LOCAL_RANK
    "FSDP_MEM_OTEL_PROMETHEUS_ADDR": "prometheus_addr",  # bind address (default 0.0.0.0)
    "FSDP_MEM_OTEL_TLS_CERTFILE": "tls_certfile",  # serve HTTPS with this certificate (PEM)
    "FSDP_MEM_OTEL_TLS_KEYFILE": "tls_keyfile",  # its private key (PEM)
    "FSDP_MEM_OTEL_TLS_CLIENT_CAFILE": "tls_client_cafile",  # require client certs from this CA (mTLS)
    "FSDP_MEM_OTEL_DETAIL": "detail",  # export module x state x category bytes (many series)
    "FSDP_MEM_OTEL_SIDECAR_DIR": "sidecar_dir",  # write rank-<rank>.prom here for `fsdp-mem-otel serve`
    "FSDP_MEM_OTEL_JSONL": "jsonl",  # append StepReports as JSON lines; "{rank}" is filled in
    "FSDP_MEM_OTEL_SPANS_EVERY": "spans_every",  # export spans for step 1 and every Nth step
}


@dataclass
class ExportConfig:
    """Where StepReports go (see EXPORT_ENV_FIELDS for the environment names).

    Attributes:
        prometheus: serve /metrics on ``prometheus_port + LOCAL_RANK``.
        prometheus_port: first port (1-65535).
        prometheus_addr: bind address.
        tls_certfile, tls_keyfile: HTTPS for the endpoint (both or neither).
        tls_client_cafile: with TLS, require client certificates signed by this CA.
        detail: also export module x state x category bytes.
        sidecar_dir: write each step's exposition to ``<dir>/rank-<rank>.prom``.
        jsonl: path of the JSON-lines file; ``{rank}`` is replaced by the rank.
        spans_every: OpenTelemetry spans for step 1 and every Nth step (when an OTLP endpoint is set).
    """

    prometheus: bool = True
    prometheus_port: int = 9400
    prometheus_addr: str = "0.0.0.0"
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    tls_client_cafile: str | None = None
    detail: bool = False
    sidecar_dir: str | None = None
    jsonl: str | None = None
    spans_every: int = 1

    def __post_init__(self) -> None:
        for name in ("prometheus", "detail"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {type(getattr(self, name)).__name__}")
        port = self.prometheus_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"prometheus_port must be an integer in 1..65535; got {port!r}")
        spans = self.spans_every
        if isinstance(spans, bool) or not isinstance(spans, int) or spans < 1:
            raise ValueError(f"spans_every must be an integer >= 1; got {spans!r}")
        if not isinstance(self.prometheus_addr, str) or not self.prometheus_addr:
            raise ValueError(f"prometheus_addr must be a non-empty address; got {self.prometheus_addr!r}")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together: set both for TLS, or neither")
        if self.tls_client_cafile is not None and self.tls_certfile is None:
            raise ValueError("tls_client_cafile (mutual TLS) needs tls_certfile and tls_keyfile")
        for name in ("tls_certfile", "tls_keyfile", "tls_client_cafile"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {path!r}")

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
    if isinstance(default, bool):
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{var} must be one of 1/0/true/false/yes/no/on/off; got {raw!r}")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{var} must be an integer; got {raw!r}") from None
    return raw.strip()
