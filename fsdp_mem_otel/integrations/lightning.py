"""Lightning: ``lightning.pytorch.Trainer(..., callbacks=[FSDPMemoryCallback()])``.

The tracker attaches at ``on_train_start`` to the model the strategy trains (FSDP2 through
``ModelParallelStrategy`` and ``configure_model``, or FSDP1 through ``FSDPStrategy``) and the
first optimizer, accounts each batch as inputs at ``on_train_batch_start``, and closes one step
per optimizer step: at ``on_train_batch_end`` of the micro-batch whose optimizer step ran
(``trainer.global_step`` moved), so ``accumulate_grad_batches`` micro-batches make one report and
the gradients are still alive (Lightning zeroes them at the next step's first micro-batch).
Lightning steps through ``optimizer.step(closure)``; the tracker labels the closure's forward
and backward as such, not as optimizer work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.exporters import Exporter
from fsdp_mem_otel.exporters.worker import mark_end
from fsdp_mem_otel.fleet.catalog import END_ERROR
from fsdp_mem_otel.integrations._session import OnReport, TrackingSession


class FSDPMemoryCallback(pl.Callback):  # type: ignore[misc]
    """Per-module FSDP memory for every optimizer step of a Lightning ``Trainer`` run.

    Args:
        config: how to measure (default: ``TrackerConfig.from_env()``).
        exporters: where reports go (default: the environment's, as ``FSDPMemoryTracker.from_env``).
        on_report: called with each ``StepReport``.
    """

    def __init__(self, config: TrackerConfig | None = None, exporters: Sequence[Exporter] | None = None,
                 on_report: OnReport | None = None) -> None:
        self.session = TrackingSession(config, exporters, on_report)
        self._global_step = 0

    @property
    def tracker(self) -> Any:
        """The FSDPMemoryTracker once training started (None before, or if it could not start)."""
        return self.session.tracker

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = trainer.optimizers
        self._global_step = trainer.global_step
        self.session.start(trainer.strategy.model, optimizers[0] if optimizers else None, watch_inputs=False)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.session.track_inputs(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._global_step:  # this micro-batch ran the optimizer step
            self._global_step = trainer.global_step
            self.session.step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        mark_end(END_ERROR)  # the rank files record a failed end, not a clean one
        self.session.close()
