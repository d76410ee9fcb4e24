"""The one background worker behind every exporter that writes or sends. Standard library only.

An exporter's ``export()`` runs on the training thread and must return at once, so the JSON-lines
writer, the sidecar file writer and the span builder each hand their work to a
``BackgroundWorker``: one daemon thread that handles items in order. They share one behaviour:

- Bounded: at most ``max_items`` items and ``max_bytes`` bytes (each item's size as given by
  ``submit``) wait; beyond that the oldest waiting items are dropped and counted (``dropped``),
  so a stalled file system or collector costs a bounded amount of memory and never blocks.
- ``coalesce=True``: only the newest item matters (a file that holds the latest state): a new
  item replaces the one waiting.
- ``idle``: called every ``idle_seconds`` while nothing arrives (a heartbeat).
- ``flush(timeout)`` waits until everything submitted so far is handled.
- ``shutdown(timeout)`` handles what is still waiting until a deadline, then stops: what is left
  is dropped and counted, and a handler stuck in I/O is abandoned (the thread is a daemon), so a
  process never hangs on exit. Safe to call twice.
- At interpreter exit (``atexit``) and on SIGTERM (preemption, eviction, ``kill``) every live
  worker is shut down, each within ``EXIT_DEADLINE_SECONDS``; the SIGTERM handler then calls the
  handler that was installed before it (or, if that was the default, terminates the process as
  the default would). Set ``FSDP_MEM_OTEL_SIGTERM=0`` to leave SIGTERM alone.
- ``stalled(seconds)``: the handler has been busy with one item for longer than that.

Why the process ends (``end_reason()``, which the Prometheus exporter writes into its last rank
file): ``sigterm`` once the SIGTERM handler ran; what ``mark_end()`` was told (a framework's
exception hook says ``error``); ``error`` when an uncaught exception is ending the interpreter
(``sys.last_value`` is set before ``atexit`` runs); else ``clean``.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from fsdp_mem_otel import env
from fsdp_mem_otel.failures import FailureLog
from fsdp_mem_otel.fleet import catalog

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: seconds each worker gets to finish at interpreter exit or on SIGTERM
EXIT_DEADLINE_SECONDS = 3.0
#: "0" / "false": do not install the SIGTERM handler that flushes the workers
ENV_SIGTERM = env.FSDP_MEM_OTEL_SIGTERM

_NOTHING: Any = object()
_LIVE: weakref.WeakSet[BackgroundWorker[Any]] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
_atexit_registered = False
_sigterm_installed = False
_previous_sigterm: Any = None
_end_reason: str | None = None


def mark_end(reason: str) -> None:
    """Say why this process is ending (one of ``catalog.END_REASONS``), before the exporters shut
    down: a framework's exception hook calls ``mark_end("error")``. The first reason given stays."""
    global _end_reason
    if reason not in catalog.END_REASONS:
        raise ValueError(f"reason must be one of {catalog.END_REASONS}; got {reason!r}")
    if _end_reason is None:
        _end_reason = reason


def end_reason() -> str:
    """Why this process is ending, as far as it can tell (see the module docstring)."""
    if _end_reason is not None:
        return _end_reason
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception: the interpreter is going down
        return catalog.END_ERROR
    return catalog.END_CLEAN


class BackgroundWorker(Generic[T]):
    """One daemon thread calling ``handle(item)`` for each submitted item, in order.

    Args:
        name: the thread's name (``fsdp-mem-otel-<name>``) and how failures are reported.
        handle: does the work; an exception it raises is counted in ``failures`` and logged once.
        failures: the owner's FailureLog (dropped items and handler exceptions are counted there).
        max_items, max_bytes: what may wait at most (see the module docstring); None = unbounded.
        coalesce: keep only the newest waiting item.
        idle, idle_seconds: heartbeat called while nothing arrives.
        on_closing: called once ``shutdown()`` has begun (then ``closing`` is true), from the thread
            that shuts the worker down: wakes a handler that waits on a condition of its own.
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[T], object],
        failures: FailureLog,
        *,
        max_items: int | None = 1000,
        max_bytes: int | None = None,
        coalesce: bool = False,
        idle: Callable[[], object] | None = None,
        idle_seconds: float = 10.0,
        on_closing: Callable[[], object] | None = None,
    ) -> None:
        self.name = name
        self._handle = handle
        self._failures = failures
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._coalesce = coalesce
        self._idle = idle
        self._idle_seconds = idle_seconds
        self._on_closing = on_closing
        self._queue: collections.deque[tuple[T, int]] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._submitted = 0
        self._finished = 0  # handled, failed or dropped
        self._busy_since: float | None = None
        self._closing = False
        self._closed = False
        self.dropped = 0
        self.handled = 0
        self._thread = threading.Thread(target=self._run, name=f"fsdp-mem-otel-{name}", daemon=True)
        self._thread.start()
        with _LIVE_LOCK:
            _LIVE.add(self)
        _install_exit_handlers()

    # -- the owner's side -------------------------------------------------------------------------
    def submit(self, item: T, size: int = 0) -> bool:
        """Queue ``item`` (of ``size`` bytes); returns False when the worker is shut down."""
        dropped = 0
        with self._cond:
            if self._closing:
                return False
            self._submitted += 1
            if self._coalesce and self._queue:  # superseded, not lost: neither counted nor warned about
                self._drop_oldest(len(self._queue), counted=False)
            self._queue.append((item, size))
            self._queued_bytes += size
            while len(self._queue) > 1 and self._over_budget():
                dropped += self._drop_oldest(1, counted=True)
            self._cond.notify_all()
        if dropped:
            self._failures.warn_once(
                f"{self.name}-drop", f"{self.name} is behind; dropping the oldest waiting items to stay within "
                f"{self._max_items} items / {self._max_bytes} bytes (counted)")
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every item submitted so far is handled (or dropped); False on timeout."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._finished >= target or not self._thread.is_alive(), timeout)

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Handle what waits until ``timeout`` seconds from now, then stop; what is left is
        dropped and counted. True when everything was handled. Safe to call twice."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._closed:
                return self._finished >= self._submitted
            self._closing = True
            self._cond.notify_all()
        if self._on_closing is not None:
            try:
                self._on_closing()
            except Exception:  # noqa: BLE001 - exit paths never raise
                logger.exception("fsdp_mem_otel: waking %s's handler failed", self.name)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._closed = True
            left = len(self._queue)
            if left:
                self._drop_oldest(left, counted=True)
            self._cond.notify_all()
            done = self._finished >= self._submitted and not self._thread.is_alive()
        if not done:
            logger.warning("fsdp_mem_otel: %s did not finish within %.1f s; %d items not handled",
                           self.name, timeout, left + (1 if self._busy_since is not None else 0))
        with _LIVE_LOCK:
            _LIVE.discard(self)
        return done

    def stalled(self, seconds: float) -> bool:
        """The handler has been working on one item for more than ``seconds``."""
        since = self._busy_since
        return since is not None and time.monotonic() - since > seconds

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def closing(self) -> bool:
        """``shutdown()`` has begun (here, at exit or on SIGTERM): a handler should not dawdle."""
        return self._closing

    # -- the thread's side ------------------------------------------------------------------------
    def _over_budget(self) -> bool:
        return (self._max_items is not None and len(self._queue) > self._max_items) or (
            self._max_bytes is not None and self._queued_bytes > self._max_bytes)

    def _drop_oldest(self, n: int, counted: bool) -> int:
        for _ in range(n):
            _, size = self._queue.popleft()
            self._queued_bytes -= size
            self._finished += 1
            if counted:
                self.dropped += 1
        if counted:
            self._failures.count(n)
        return n

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing, self._idle_seconds)
                if self._queue:
                    item, size = self._queue.popleft()
                    self._queued_bytes -= size
                    self._busy_since = time.monotonic()
                elif self._closing:
                    return
                else:
                    item = _NOTHING
            if item is _NOTHING:  # nothing arrived for idle_seconds
                if self._idle is not None:
                    try:
                        self._idle()
                    except Exception as exc:  # noqa: BLE001 - the thread must survive anything
                        self._failures.failed(f"{self.name} heartbeat", exc)
                continue
            try:
                self._handle(item)
            except Exception as exc:  # noqa: BLE001 - the thread must survive anything
                self._failures.failed(self.name, exc)
            with self._cond:
                self._busy_since = None
                self._finished += 1
                self.handled += 1
                self._cond.notify_all()


_EXIT_CALLBACKS: list[weakref.WeakMethod[Callable[[], object]]] = []


def at_exit(method: Callable[[], object]) -> None:
    """Call the bound ``method`` (an exporter's ``shutdown``) at interpreter exit and on SIGTERM,
    before the workers are shut down; held weakly, so its object can still be collected."""
    with _LIVE_LOCK:
        _EXIT_CALLBACKS.append(weakref.WeakMethod(method))  # type: ignore[arg-type]
    _install_exit_handlers()


def shutdown_all(timeout: float = EXIT_DEADLINE_SECONDS) -> None:
    """Shut down every exporter registered with ``at_exit`` and every live worker, each worker
    within ``timeout`` seconds (at exit, on SIGTERM)."""
    with _LIVE_LOCK:
        callbacks = [ref() for ref in _EXIT_CALLBACKS]
        _EXIT_CALLBACKS.clear()
        workers = list(_LIVE)
    for fn in callbacks:
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - exit paths never raise
                logger.exception("fsdp_mem_otel: shutdown at exit failed")
    for w in workers:
        try:
            w.shutdown(timeout)
        except Exception:  # noqa: BLE001 - exit paths never raise
            logger.exception("fsdp_mem_otel: shutting down %s failed", w.name)


def _on_sigterm(signum: int, frame: Any) -> None:
    mark_end(catalog.END_SIGTERM)
    shutdown_all()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # the default action: terminate, as if no handler had been installed
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_exit_handlers() -> None:
    global _atexit_registered, _sigterm_installed, _previous_sigterm
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(shutdown_all)
    if _sigterm_installed or os.environ.get(ENV_SIGTERM, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be installed from the main thread: try with the next worker
    try:
        _previous_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
        _sigterm_installed = True
    except (ValueError, OSError):  # embedded interpreters without signals
        logger.debug("fsdp_mem_otel: cannot install a SIGTERM handler", exc_info=True)
