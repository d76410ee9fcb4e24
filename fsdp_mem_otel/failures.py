"""Count it and log it once: the one failure policy of every component. Standard library only.

A component (the tracker, an exporter, the sidecar server) owns one ``FailureLog``. Each failure
is counted; the first of each kind is logged at ERROR with its traceback, the rest are not
logged. When a component sees a kind of failure work again (a disk that had filled up, an
endpoint that came back) it calls ``recovered(kind)``: that is logged at WARNING, and the next
failure of that kind is logged again. Degradations that are not failures (reports dropped to
keep memory bounded) use ``warn_once`` at WARNING. The models: opentelemetry-python's
``DuplicateFilter``, torchtitan's ``warn_once``.
"""

from __future__ import annotations

import logging
import threading


class FailureLog:
    """Failures of one component: counted in ``total``, logged once per kind (per outage).

    Args:
        logger: where to log (the component's own ``logging.getLogger(__name__)``).
        component: how log lines name the component ("JSONL exporter", "tracker", ...).
    """

    def __init__(self, logger: logging.Logger, component: str) -> None:
        self.logger = logger
        self.component = component
        self.total = 0
        #: the last failure, in words (``kind: TYPE: message: detail``); None before any
        self.last: str | None = None
        self._failing: set[str] = set()
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, kind: str, exc: BaseException | None = None, detail: str = "") -> bool:
        """Count one failure of ``kind``; log it if it is the first since the kind last worked.
        Returns whether it was logged. Thread-safe; never raises."""
        what = f"{kind} failed" + (f" ({detail})" if detail else "") + (
            f": {type(exc).__name__}: {exc}" if exc is not None else "")
        with self._lock:
            self.total += 1
            self.last = what
            first = kind not in self._failing
            self._failing.add(kind)
        if first:
            text = f": {detail}" if detail else ""
            self.logger.error("fsdp_mem_otel: %s: %s failed (counted; logged again only after it recovers)%s",
                              self.component, kind, text, exc_info=exc)
        return first

    def __str__(self) -> str:
        """The failures in words: how many, and the last (for messages; ``repr`` says the same)."""
        if not self.total:
            return f"{self.component}: no failures"
        last = f"; last: {self.last}" if self.last else ""
        return f"{self.component}: {self.total} failure{'s' if self.total != 1 else ''}{last}"

    def __repr__(self) -> str:
        return f"<FailureLog {self}>"

    def count(self, n: int = 1) -> None:
        """Count ``n`` failures that are logged elsewhere (or warned about once)."""
        with self._lock:
            self.total += n

    def recovered(self, kind: str) -> None:
        """``kind`` works again: say so once, and log its next failure again."""
        with self._lock:
            was_failing = kind in self._failing
            self._failing.discard(kind)
        if was_failing:
            self.logger.warning("fsdp_mem_otel: %s: %s recovered, works again", self.component, kind)

    @property
    def kinds_logged(self) -> int:
        """How many kinds of failure are failing now (each was logged once)."""
        return len(self._failing)

    def failing(self, kind: str) -> bool:
        """Whether ``kind`` failed last time it was tried."""
        return kind in self._failing

    def warn_once(self, kind: str, message: str) -> None:
        """Log a degradation (not a failure) once per kind, at WARNING; not counted."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            self.logger.warning("fsdp_mem_otel: %s: %s", self.component, message)
