"""Exporters turn StepReports into telemetry. They never import torch.

An exporter is any object with ``export(report)`` and ``shutdown()``. The tracker calls
``export`` once per step from the training thread, so an exporter must return quickly (hand work
to a background thread if it does I/O), must never raise for I/O failures it can handle itself,
and counts its own failures in ``errors_total``. ``shutdown()`` is safe to call twice.
"""

from __future__ import annotations

from typing import Protocol

from fsdp_mem_otel.model import StepReport


class Exporter(Protocol):
    """What the tracker fans StepReports out to."""

    def export(self, report: StepReport) -> None:
        """Take one step's report. Return quickly; never block the training step."""

    def shutdown(self) -> None:
        """Flush and release resources. Safe to call twice."""
