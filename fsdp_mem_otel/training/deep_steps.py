"""Deep-mode control: which steps run deep, when the dispatch mode goes on and off, and the compile stance. A step
due to run deep enters ``DeepMode`` at its first FSDP forward, where a compiled caller shows (entered earlier, the
mode would make dynamo run that caller eagerly). On a model that runs compiled code the step stays light
(``skipped``), unless ``deep_when_compiled="eager"`` runs it all eagerly. Failures go to ``on_error``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.schema import DEEP, DEEP_SKIPPED_COMPILED, LIGHT
from fsdp_mem_otel.training.compile_support import called_from_compiled_code, compiled_regions, force_eager
from fsdp_mem_otel.training.deep import RESIZE_WATCH, DeepMode
from fsdp_mem_otel.training.light.ledger import Ledger
from fsdp_mem_otel.training.light.recorder import StepContext
from fsdp_mem_otel.training.light.sink import Sink

logger = logging.getLogger(__name__)


class DeepSteps:
    """Runs the steps due to run deep in deep mode, from their first FSDP forward to their end."""

    def __init__(self, config: TrackerConfig, model: nn.Module, ledger: Ledger, context: StepContext, sink: Sink,
                 adapter: Any, on_error: Callable[[BaseException], None]) -> None:
        self._config = config
        self._model = model
        self._ledger = ledger
        self._context = context
        self._sink = sink
        self._adapter = adapter
        self._on_error = on_error
        self._mode: DeepMode | None = None
        self._restore_stance: Callable[[], None] | None = None
        self._called_from_compiled = False  # an FSDP forward ran under a compiled caller
        #: "light" or "deep": what the current step ran as
        self.step_mode = LIGHT
        #: why the current step, due to run deep, stayed light (``DEEP_SKIPPED_COMPILED``), or None
        self.skipped: str | None = None
        #: deep steps that stayed light, by reason
        self.skipped_total: dict[str, int] = {}
        sink.on_forward = self.start_pending

    @property
    def active(self) -> bool:
        """The dispatch mode is on (the current step runs deep)."""
        return self._mode is not None

    def begin(self, step: int, allowed: bool = True) -> None:
        """Step ``step`` begins: arm deep mode for its first forward if it is due (and ``allowed``)."""
        self.step_mode, self.skipped = LIGHT, None
        self._sink.forward_pending = False
        if not allowed or not self._config.is_deep(step):
            return
        if self._runs_compiled_code():
            if self._config.deep_when_compiled == "skip":
                self._skip()
            else:
                self._enter()  # deep_when_compiled="eager": the whole step runs eagerly
            return
        self._sink.forward_pending = True

    def start_pending(self) -> None:
        """The step's first FSDP forward of a deep step: go deep, unless compiled code called it."""
        if called_from_compiled_code():
            self._called_from_compiled = True
            self._skip()
        else:
            self._enter()

    def end(self) -> None:
        """The step ends (or the tracker detaches): leave deep mode if it is on."""
        mode, self._mode = self._mode, None
        self._sink.forward_pending = False
        if mode is None:
            return
        self._ledger.offer_on_add = True
        self._ledger.defer(True)  # light again: queue changes until read (Ledger.defer)
        self._sink.deep = False
        RESIZE_WATCH.discard(self._ledger)
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if _get_current_dispatch_mode() is not mode:
                raise RuntimeError(
                    "deep-mode dispatch mode is not the innermost active mode at step(); "
                    "call tracker.step() outside any other TorchDispatchMode, on the training thread"
                )
            mode.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001
            self._on_error(exc)
        try:
            self._adapter.use_tensors(False)
        except Exception as exc:  # noqa: BLE001
            self._on_error(exc)
        self._restore()

    def _skip(self) -> None:
        self.step_mode, self.skipped = LIGHT, DEEP_SKIPPED_COMPILED
        self.skipped_total[DEEP_SKIPPED_COMPILED] = self.skipped_total.get(DEEP_SKIPPED_COMPILED, 0) + 1
        if self.skipped_total[DEEP_SKIPPED_COMPILED] == 1:
            logger.warning(
                "fsdp_mem_otel: deep steps stay light on this model: it runs torch.compile'd code, which a "
                "deep step would run eagerly (set deep_when_compiled='eager' / FSDP_MEM_OTEL_DEEP_WHEN_COMPILED"
                "=eager to measure such steps eagerly)"
            )

    def _runs_compiled_code(self) -> bool:
        if self._called_from_compiled:
            return True
        try:
            return bool(compiled_regions(self._model))
        except Exception as exc:  # noqa: BLE001
            self._on_error(exc)
            return True  # unsure: do not risk running compiled code eagerly

    def _enter(self) -> None:
        if self._mode is not None:
            return
        try:
            if self._config.deep_when_compiled == "eager" and self._runs_compiled_code():
                self._restore_stance = force_eager()
            mode = DeepMode(self._ledger, self._context, self._on_error)
            mode.__enter__()
            self._mode = mode
            self._ledger.defer(False)  # deep mode reads the counters at every op
            RESIZE_WATCH.add(self._ledger)
            self._ledger.offer_on_add = False
            self._sink.deep = True
            self.step_mode = DEEP
            self._adapter.use_tensors(True)
        except Exception as exc:  # noqa: BLE001
            self.step_mode = LIGHT
            if self._mode is not None:  # entered: undo all of it (a half-done step goes light)
                self.end()
            else:
                self._ledger.defer(True)
                self._restore()
            self._on_error(exc)

    def _restore(self) -> None:
        restore, self._restore_stance = self._restore_stance, None
        if restore is not None:
            try:
                restore()
            except Exception as exc:  # noqa: BLE001
                self._on_error(exc)
