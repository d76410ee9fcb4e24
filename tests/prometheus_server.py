"""A real Prometheus server (Debian's ``prometheus``) on loopback for the tests that query one:
started with the given flags, ready before use, stopped (and its log closed) afterwards."""

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


@contextmanager
def running_prometheus(log: Path, port: int, *flags: str, ready_timeout: float = 30.0) -> Iterator[str]:
    """Prometheus with ``flags`` listening on 127.0.0.1:``port``, its output in ``log``; yields its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("this test needs the Prometheus server (Debian package prometheus)")
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen([binary, *flags, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(base, proc, ready_timeout)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
