"""A real Prometheus server (Debian's ``prometheus``) on loopback for the tests that query one:
started with the given flags, ready before use, stopped (and its log closed) afterwards.
``PrometheusProcess`` is the same server for tests that stop and restart it (tests/deploy/test_faults.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Until ``base``/-/ready answers 200; RuntimeError if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("prometheus did not become ready")


class PrometheusProcess:
    """Prometheus with ``flags`` on 127.0.0.1:``port``, its output appended to ``log``; ``start()``
    (ready when it returns), ``stop()`` (SIGTERM: a clean shutdown, queues flushed) and ``kill()``
    (SIGKILL: a lost node) as often as wanted, on the same storage."""

    def __init__(self, log: Path, port: int, *flags: str, ready_timeout: float = 30.0) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("this test needs the Prometheus server (Debian package prometheus)")
        self.argv = [binary, *flags, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        self.log, self.ready_timeout = log, ready_timeout
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(self.base, self.proc, self.ready_timeout)
        except RuntimeError:
            self.kill()
            raise
        return self.base

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()


@contextmanager
def running_prometheus(log: Path, port: int, *flags: str, ready_timeout: float = 30.0) -> Iterator[str]:
    """Prometheus with ``flags`` listening on 127.0.0.1:``port``, its output in ``log``; yields its URL."""
    server = PrometheusProcess(log, port, *flags, ready_timeout=ready_timeout)
    log.write_bytes(b"")
    try:
        yield server.start()
    finally:
        server.stop()
