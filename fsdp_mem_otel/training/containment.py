"""Containment: the tracker's own failures and the steps training aborted. ``ErrorPolicy`` counts every failure,
logs each kind once and, after ``max_errors`` of the tracker's own (exporters' don't count), calls ``on_disable``.
``StepAborts`` keeps why and where the step stopped (``record``, a forward seen raising, ``step()`` with a pass
open): no exception, only its name, message, the FSDP module and state, and the live breakdown."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from fsdp_mem_otel.failures import FailureLog
from fsdp_mem_otel.schema import StepAbort
from fsdp_mem_otel.training.allocator import AllocatorProbe
from fsdp_mem_otel.training.light.ledger import Ledger
from fsdp_mem_otel.training.light.recorder import StepRecorder

logger = logging.getLogger(__name__)


class ErrorPolicy:
    """Counts and logs failures; after ``max_errors`` of its own (0: never), calls ``on_disable`` once."""

    def __init__(self, max_errors: int, on_disable: Callable[[], None], log: logging.Logger = logger) -> None:
        self.failures = FailureLog(log, "tracker")
        self._max = max_errors
        self._on_disable = on_disable
        self._own = 0
        #: the limit was reached: the tracker switched itself off
        self.disabled = False

    @property
    def total(self) -> int:
        """Failures so far, exporters' included."""
        return self.failures.total

    def report(self, exc: BaseException, may_disable: bool = True) -> None:
        """Count ``exc``, log its kind once; exporter failures pass ``may_disable=False``."""
        self.failures.failed(f"{type(exc).__name__} at {_origin(exc)}", exc, repr(exc))
        if may_disable:
            self._own += 1
        if self._max and self._own >= self._max and not self.disabled:
            self.disabled = True
            logger.error("fsdp_mem_otel: %d internal errors, the tracker detached itself (training continues)",
                         self.total)
            try:
                self._on_disable()
            except Exception:  # noqa: BLE001
                logger.exception("fsdp_mem_otel: detach after errors failed")


class StepAborts:
    """Why and where the current step stopped early, if it did (``current``)."""

    def __init__(self, recorder: StepRecorder, ledger: Ledger, probe: AllocatorProbe,
                 on_error: Callable[[BaseException], None]) -> None:
        self._recorder = recorder
        self._ledger = ledger
        self._probe = probe
        self._on_error = on_error
        self.current: StepAbort | None = None

    def record(self, exc: BaseException) -> None:
        """The step stopped on ``exc`` (the first one of a step counts)."""
        if self.current is None:
            self.current = self._make(type(exc).__name__, str(exc)[:500], is_oom(exc))

    def incomplete(self) -> None:
        """``step()`` while a forward or backward pass is still open, and nothing recorded."""
        if self.current is None and self._recorder.in_pass:
            self.current = self._make(
                "IncompleteStep", "step() called while a forward or backward pass was still open", False)

    def take(self) -> StepAbort | None:
        """This step's abort (None if it completed); the next step starts clean."""
        abort, self.current = self.current, None
        return abort

    def _make(self, error: str, message: str, oom: bool) -> StepAbort:
        module, state = self._recorder.location()
        abort = StepAbort(error, message, oom, module, state, self._ledger.snapshot())
        try:
            abort.outside_pytorch_bytes = self._probe.outside_pytorch()
        except Exception as exc:  # noqa: BLE001 - the abort itself must be kept
            self._on_error(exc)
        return abort


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error (torch's, or one whose message says so)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _origin(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
