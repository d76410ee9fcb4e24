"""What both framework callbacks share: start a tracker safely, account forward inputs, stop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.exporters import Exporter
from fsdp_mem_otel.schema import StepReport

logger = logging.getLogger(__name__)
OnReport = Callable[[StepReport], None]


class TrackingSession:
    """One tracker for one training run, started when the framework's model is ready.

    ``start`` never raises into training: a model the tracker refuses (say, a framework that did
    not apply FSDP) logs why and leaves the session off.
    """

    def __init__(self, config: TrackerConfig | None, exporters: Sequence[Exporter] | None,
                 on_report: OnReport | None) -> None:
        if config is not None and not isinstance(config, TrackerConfig):
            raise TypeError(f"config must be a TrackerConfig or None; got {type(config).__name__}")
        if on_report is not None and not callable(on_report):
            raise TypeError(f"on_report must be callable (report -> None) or None; got {type(on_report).__name__}")
        self._config = config
        self._exporters = exporters
        self._on_report = on_report
        self.tracker: Any = None
        self.failed: str | None = None  # why the session did not start
        self._input_hook: Any = None

    @property
    def active(self) -> bool:
        return self.tracker is not None and self.tracker.attached

    def start(self, model: nn.Module, optimizer: Any, *, watch_inputs: bool) -> None:
        """Build and attach the tracker (once); ``watch_inputs``: account every forward's
        arguments of ``model`` as inputs (for frameworks that never show callbacks the batch)."""
        if self.tracker is not None or self.failed is not None:
            return
        from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

        try:
            if self._config is None and self._exporters is None:
                tracker = FSDPMemoryTracker.from_env(model, optimizer)
            else:
                tracker = FSDPMemoryTracker(model, optimizer, config=self._config, exporters=self._exporters or ())
        except (TypeError, ValueError) as exc:
            self.failed = str(exc)
            logger.error("fsdp_mem_otel: memory tracking is off for this run: %s", exc)
            return
        self.tracker = tracker.attach()
        if watch_inputs:
            self._input_hook = model.register_forward_pre_hook(self._on_forward, with_kwargs=True, prepend=True)

    def _on_forward(self, _module: nn.Module, args: Any, kwargs: Any) -> None:
        self.tracker.track_inputs((args, kwargs))

    def track_inputs(self, batch: Any) -> None:
        if self.active:
            self.tracker.track_inputs(batch)

    def step(self) -> StepReport | None:
        """Close the tracker's step (one optimizer step); hands the report to ``on_report``."""
        if self.tracker is None:
            return None
        report = self.tracker.step()
        if self._on_report is not None:
            try:
                self._on_report(report)
            except Exception:  # noqa: BLE001 - the user's callback must not stop training
                logger.exception("fsdp_mem_otel: on_report raised (training continues)")
        return report

    def close(self) -> None:
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None
        if self.tracker is not None:
            self.tracker.close()
