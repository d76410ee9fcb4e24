"""Hugging Face ``transformers.Trainer``: ``Trainer(..., callbacks=[FSDPMemoryCallback()])``.

The tracker attaches at the first ``on_step_begin`` (the Trainer wraps the model with FSDP when
training starts, after ``on_train_begin``), takes accelerate's ``AcceleratedOptimizer`` apart to
reach the torch optimizer, closes one step at ``on_optimizer_step`` (after ``optimizer.step()``,
before the Trainer zeroes the gradients, once per optimizer step whatever
``gradient_accumulation_steps`` is), and accounts every forward's arguments as inputs (the batch
never reaches callbacks). It closes, flushing its exporters, at ``on_train_end``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.exporters import Exporter
from fsdp_mem_otel.integrations._session import OnReport, TrackingSession


class FSDPMemoryCallback(TrainerCallback):  # type: ignore[misc]
    """Per-module FSDP memory for every optimizer step of a ``transformers.Trainer`` run.

    Args:
        config: how to measure (default: ``TrackerConfig.from_env()``).
        exporters: where reports go (default: the environment's, as ``FSDPMemoryTracker.from_env``).
        on_report: called with each ``StepReport`` (e.g. to log a figure yourself).
    """

    def __init__(self, config: TrackerConfig | None = None, exporters: Sequence[Exporter] | None = None,
                 on_report: OnReport | None = None) -> None:
        self.session = TrackingSession(config, exporters, on_report)

    @property
    def tracker(self) -> Any:
        """The FSDPMemoryTracker once training started (None before, or if it could not start)."""
        return self.session.tracker

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                      **kwargs: Any) -> None:
        if model is not None:
            self.session.start(model, optimizer, watch_inputs=True)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.close()
