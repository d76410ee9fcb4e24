"""The one background worker and the one failure policy, driven directly (and through real
processes for interpreter exit and SIGTERM)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fsdp_mem_otel.exporters.worker import BackgroundWorker
from fsdp_mem_otel.failures import FailureLog

log = logging.getLogger("test_worker")


def _failures() -> FailureLog:
    return FailureLog(log, "test")


def test_items_handled_in_order_and_flushed() -> None:
    seen: list[int] = []
    w = BackgroundWorker("order", seen.append, _failures())
    for i in range(50):
        w.submit(i)
    assert w.flush(5)
    assert seen == list(range(50))
    assert w.shutdown(5)
    assert not w.submit(51)  # shut down: refused


def test_bounded_by_count_and_bytes_drops_oldest_and_counts() -> None:
    gate = threading.Event()
    seen: list[int] = []

    def handle(i: int) -> None:
        gate.wait(5)
        seen.append(i)

    failures = _failures()
    w = BackgroundWorker("bounded", handle, failures, max_items=3, max_bytes=250)
    w.submit(0, 10)  # taken by the thread, blocked on the gate
    time.sleep(0.2)
    for i in range(1, 6):
        w.submit(i, 100)  # 100 bytes each: only two fit in 250
    assert w.waiting == 2
    gate.set()
    assert w.flush(5)
    assert seen == [0, 4, 5]  # the newest kept, the oldest dropped
    assert w.dropped == 3 and failures.total == 3
    w.shutdown(5)


def test_coalesce_keeps_only_the_newest() -> None:
    gate = threading.Event()
    seen: list[str] = []
    w = BackgroundWorker("coalesce", lambda s: (gate.wait(5), seen.append(s)), _failures(), coalesce=True)
    w.submit("first")
    time.sleep(0.2)
    for s in ("a", "b", "latest"):
        w.submit(s)
    gate.set()
    assert w.flush(5)
    assert seen == ["first", "latest"]
    assert w.dropped == 0  # superseded, not lost
    w.shutdown(5)


def test_coalescing_is_not_reported_as_falling_behind(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    failures = _failures()
    w = BackgroundWorker("coalesce", lambda _: gate.wait(5), failures, coalesce=True)
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            w.submit(i)
        gate.set()
        assert w.flush(5)
    assert failures.total == 0 and not [r for r in caplog.records if "behind" in r.getMessage()]
    w.shutdown(5)


def test_idle_heartbeat() -> None:
    beats: list[float] = []
    w = BackgroundWorker("idle", lambda _: None, _failures(), idle=lambda: beats.append(time.monotonic()),
                         idle_seconds=0.05)
    time.sleep(0.5)
    w.shutdown(5)
    assert len(beats) >= 3


def test_failures_are_counted_logged_once_and_recover(caplog: pytest.LogCaptureFixture) -> None:
    failures = _failures()
    broken = {"on": True}

    def handle(_: int) -> None:
        if broken["on"]:
            raise OSError("disk full")
        failures.recovered("write")

    def guarded(i: int) -> None:
        try:
            handle(i)
        except OSError as exc:
            failures.failed("write", exc)

    w = BackgroundWorker("fail", guarded, failures)
    with caplog.at_level(logging.INFO, logger="test_worker"):
        for i in range(5):
            w.submit(i)
        w.flush(5)
        broken["on"] = False
        w.submit(5)
        w.flush(5)
        broken["on"] = True
        w.submit(6)
        w.flush(5)
    w.shutdown(5)
    assert failures.total == 6
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2  # once per outage
    assert sum(r.levelno == logging.WARNING and "works again" in r.getMessage() for r in caplog.records) == 1


def test_shutdown_has_a_deadline_with_a_stuck_handler() -> None:
    stuck = threading.Event()
    failures = _failures()
    w = BackgroundWorker("stuck", lambda _: stuck.wait(30), failures)
    for i in range(4):
        w.submit(i)
    time.sleep(0.2)
    assert w.stalled(0.1)
    t0 = time.monotonic()
    assert not w.shutdown(0.5)
    assert time.monotonic() - t0 < 2
    assert w.dropped == 3 and failures.total == 3  # the waiting ones; the stuck one is abandoned
    stuck.set()


def test_on_closing_wakes_a_handler_waiting_on_its_own_condition() -> None:
    """A handler that waits on a condition of its own (the sidecar writer waiting out its
    interval) is woken by ``on_closing`` when the worker shuts down, instead of polling."""
    cond = threading.Condition()
    waited: list[float] = []
    w: BackgroundWorker[int]

    def handle(_: int) -> None:
        t0 = time.monotonic()
        with cond:
            while not w.closing:
                cond.wait(30)
        waited.append(time.monotonic() - t0)

    def wake() -> None:
        with cond:
            cond.notify_all()

    w = BackgroundWorker("waits", handle, _failures(), on_closing=wake)
    w.submit(1)
    time.sleep(0.2)
    t0 = time.monotonic()
    assert w.shutdown(5)
    assert time.monotonic() - t0 < 2 and len(waited) == 1 and waited[0] < 2


_CHILD = textwrap.dedent("""
    import os, signal, sys, time, logging
    from fsdp_mem_otel.failures import FailureLog
    from fsdp_mem_otel.exporters.worker import BackgroundWorker
    out = open(sys.argv[1], "a")
    def handle(i):
        time.sleep(0.05)  # slow I/O: the items are still waiting when the end comes
        out.write(f"{i}\\n"); out.flush()
    if sys.argv[2] == "chain":
        signal.signal(signal.SIGTERM, lambda s, f: (out.write("previous handler\\n"), out.flush(), sys.exit(7)))
    w = BackgroundWorker("child", handle, FailureLog(logging.getLogger("c"), "child"))
    for i in range(10):
        w.submit(i)
    if sys.argv[2] == "exit":
        sys.exit(0)  # no shutdown(): atexit drains
    print("ready", flush=True)
    for _ in range(600):  # short sleeps: a SIGTERM landing just before one long sleep would wait it out
        time.sleep(0.1)
""")


@pytest.mark.parametrize("how", ["exit", "sigterm", "chain"])
def test_exit_and_sigterm_flush_what_waits(tmp_path: Path, how: str) -> None:
    out = tmp_path / "out.txt"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(out), how], stdout=subprocess.PIPE, text=True)
    if how != "exit":
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    lines = out.read_text().splitlines()
    assert [line for line in lines if line.isdigit()] == [str(i) for i in range(10)]  # nothing lost
    if how == "exit":
        assert rc == 0
    elif how == "sigterm":  # the default action still happens: terminated by SIGTERM
        assert rc == -signal.SIGTERM
    else:  # the handler installed before ours runs after the flush
        assert lines[-1] == "previous handler" and rc == 7
