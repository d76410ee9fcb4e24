"""Exporters turn StepReports into telemetry. They never import torch.

An exporter is any object with ``export(report)`` and ``shutdown()``. The tracker calls
``export`` once per step from the training thread, so an exporter must return quickly (hand work
to a background thread if it does I/O), must never raise for I/O failures it can handle itself,
and counts its own failures in ``errors_total``. ``shutdown()`` is safe to call twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from fsdp_mem_otel import env
from fsdp_mem_otel.config import RANK_PLACEHOLDER, ExportConfig
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import StepReport

if TYPE_CHECKING:
    from fsdp_mem_otel.exporters.jsonl import JSONLExporter

logger = logging.getLogger(__name__)


class Exporter(Protocol):
    """What the tracker fans StepReports out to."""

    def export(self, report: StepReport) -> None:
        """Take one step's report. Return quickly; never block the training step."""

    def shutdown(self) -> None:
        """Flush and release resources. Safe to call twice."""


def build_exporters(config: ExportConfig | None = None, identity: Identity | None = None, *,
                    from_env: bool | None = None) -> list[Exporter]:
    """The exporters ``config`` (default: ``ExportConfig.from_env()``) asks for.

    Prometheus per rank unless switched off; the sidecar file, JSON lines and OpenTelemetry spans
    when configured (spans: when an OTLP endpoint is set in the standard OTEL_* variables, unless
    ``config.spans`` is False). ``from_env`` (default: whether ``config`` is None): the
    configuration came from the environment, so messages name its variables.

    What a user can get wrong on a rank is said in one line and switches off that exporter alone:
    a Prometheus port in use or an address that cannot be served (``PrometheusExporter``), a JSONL
    file that cannot be opened (its folder cannot be made, a file where a folder should be, no
    permission). A JSONL path without ``{rank}`` in a job of several ranks gets the rank before
    its extension (``ExportConfig.jsonl_path``), said once, on rank 0.
    """
    from_env = config is None if from_env is None else from_env
    config = ExportConfig.from_env() if config is None else config
    identity = Identity.from_env() if identity is None else identity
    out: list[Exporter] = []
    if config.prometheus or config.sidecar_dir:
        from fsdp_mem_otel.exporters.prometheus import PrometheusExporter

        out.append(PrometheusExporter(identity, config=config.prometheus_config(), env_names=from_env))
    if config.jsonl:
        jsonl = _jsonl_exporter(config, identity, from_env)
        if jsonl is not None:
            out.append(jsonl)
    if not config.spans:
        return out
    from fsdp_mem_otel.exporters.otel import default_span_exporter

    span_exporter = default_span_exporter()
    if span_exporter is not None:
        from fsdp_mem_otel.exporters.otel import OTelSpanExporter

        out.append(OTelSpanExporter(identity, span_exporter=span_exporter, config=config.otel_config()))
    return out


def _jsonl_exporter(config: ExportConfig, identity: Identity, from_env: bool) -> JSONLExporter | None:
    """The rank's JSONL exporter, its file opened now; None (said in one line) if it cannot be."""
    from fsdp_mem_otel.exporters.jsonl import JSONLExporter

    assert config.jsonl is not None
    name = env.FSDP_MEM_OTEL_JSONL if from_env else "ExportConfig.jsonl"
    world = identity.world_size
    if identity.rank == 0 and world > 1 and RANK_PLACEHOLDER not in config.jsonl:
        logger.warning("fsdp_mem_otel: %s=%s has no {rank} and %d ranks write: each rank writes its own file, %s "
                       "(put {rank} in the path to name them yourself)", name, config.jsonl, world,
                       config.jsonl_path(f"{{0..{world - 1}}}", world))
    exporter = JSONLExporter(config=config.jsonl_config(identity.rank, world))
    try:
        exporter.open()
    except OSError as exc:
        exporter.shutdown()
        why = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc) or type(exc).__name__
        logger.error("fsdp_mem_otel: cannot write %s=%s (%s): JSONL off for this rank, the rest of tracking goes on; "
                     "point %s at a file in a folder this job can write", name, exporter.path, why, name)
        return None
    return exporter
