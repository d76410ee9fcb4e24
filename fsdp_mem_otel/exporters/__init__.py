"""Exporters turn StepReports into telemetry. They never import torch.

An exporter is any object with ``export(report)`` and ``shutdown()``. The tracker calls
``export`` once per step from the training thread, so an exporter must return quickly (hand work
to a background thread if it does I/O), must never raise for I/O failures it can handle itself,
and counts its own failures in ``errors_total``. ``shutdown()`` is safe to call twice.
"""

from __future__ import annotations

from typing import Protocol

from fsdp_mem_otel.config import ExportConfig
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import StepReport


class Exporter(Protocol):
    """What the tracker fans StepReports out to."""

    def export(self, report: StepReport) -> None:
        """Take one step's report. Return quickly; never block the training step."""

    def shutdown(self) -> None:
        """Flush and release resources. Safe to call twice."""


def build_exporters(config: ExportConfig | None = None, identity: Identity | None = None) -> list[Exporter]:
    """The exporters ``config`` (default: ``ExportConfig.from_env()``) asks for.

    Prometheus per rank unless switched off; the sidecar file, JSON lines and OpenTelemetry spans
    when configured (spans: when an OTLP endpoint is set in the standard OTEL_* variables).
    """
    config = ExportConfig.from_env() if config is None else config
    identity = Identity.from_env() if identity is None else identity
    out: list[Exporter] = []
    if config.prometheus or config.sidecar_dir:
        from fsdp_mem_otel.exporters.prometheus import PrometheusExporter

        out.append(PrometheusExporter(identity, config=config.prometheus_config()))
    if config.jsonl:
        from fsdp_mem_otel.exporters.jsonl import JSONLExporter

        out.append(JSONLExporter(config=config.jsonl_config(identity.rank)))
    from fsdp_mem_otel.exporters.otel import default_span_exporter

    span_exporter = default_span_exporter()
    if span_exporter is not None:
        from fsdp_mem_otel.exporters.otel import OTelSpanExporter

        out.append(OTelSpanExporter(identity, span_exporter=span_exporter, config=config.otel_config()))
    return out
