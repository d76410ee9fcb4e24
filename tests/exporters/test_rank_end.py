"""A rank's end is recorded in its last rank file: clean (close, interpreter exit), sigterm
(preemption), error (an uncaught exception, a framework's exception hook); a killed rank records
none. Real processes: each case runs the exporter in a Python process of its own and ends it the
way a training process ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsdp_mem_otel.exporters import worker
from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.identity import Identity
from tests.exporters.test_prometheus import promtool_check, samples, small_report

ROOT = Path(__file__).resolve().parents[2]
END = cat.RANK_END_TIMESTAMP_SECONDS.name

#: a rank process: exports one step to the sidecar directory argv[1], says "ready", then ends as
#: argv[2] says
RANK = textwrap.dedent("""
    import sys, time
    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
    from fsdp_mem_otel.identity import Identity
    from fsdp_mem_otel.exporters import worker
    from tests.exporters.test_prometheus import small_report

    directory, how = sys.argv[1], sys.argv[2]
    exporter = PrometheusExporter(Identity("job", 3, 3, 4, "h", node="node-b"), http=False, sidecar_dir=directory)
    if not how.startswith("nothing"):
        exporter.export(small_report())
        assert exporter.flush()
    print("ready", flush=True)
    if how == "close":
        exporter.shutdown()
    elif how == "raise":
        raise RuntimeError("training failed")
    elif how == "framework_error":
        worker.mark_end("error")  # what a framework's exception hook does before closing
        exporter.shutdown()
    elif how in ("wait", "nothing_wait"):
        for _ in range(1200):  # until SIGTERM or SIGKILL, in short sleeps (one long one can miss a signal)
            time.sleep(0.1)
    # "exit", "nothing": the interpreter exits normally
""")


def _run_rank(tmp_path: Path, how: str, signum: int | None = None) -> tuple[int, str | None]:
    """(exit status, the rank file's text or None) of a rank process ended as ``how`` says."""
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), how], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line + proc.stdout.read()
    if signum is not None:
        time.sleep(0.2)
        proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    path = tmp_path / "rank-3.prom"
    return proc.returncode, path.read_text() if path.exists() else None


def _ends(text: str) -> list[tuple[str, float]]:
    return [(s.labels["reason"], s.value) for s in samples(text) if s.name == END]


@pytest.mark.parametrize("how,reason,status", [
    ("close", cat.END_CLEAN, 0),  # tracker.close() / a framework's end-of-training hook
    ("exit", cat.END_CLEAN, 0),  # the script returns: interpreter exit
    ("raise", cat.END_ERROR, 1),  # an uncaught exception ends the interpreter
    ("framework_error", cat.END_ERROR, 0),  # Lightning's on_exception
])
def test_the_last_rank_file_records_how_the_rank_ended(tmp_path: Path, how: str, reason: str, status: int) -> None:
    before = time.time()
    rc, text = _run_rank(tmp_path, how)
    assert rc == status
    assert text is not None
    (got_reason, when), = _ends(text)
    assert got_reason == reason
    assert before <= when <= time.time()
    promtool_check(text)
    # the end comes with the rank's last values and its node
    assert [s.labels["node"] for s in samples(text) if s.name == cat.TRACKER_INFO.name] == ["node-b"]
    assert [s.value for s in samples(text) if s.name == "fsdp_mem_steps_total"] == [small_report().step]


def test_sigterm_is_recorded_as_such_and_still_terminates(tmp_path: Path) -> None:
    rc, text = _run_rank(tmp_path, "wait", signal.SIGTERM)
    assert rc == -signal.SIGTERM  # the default action still ends the process
    assert text is not None
    assert [r for r, _ in _ends(text)] == [cat.END_SIGTERM]


def test_a_killed_rank_records_no_end(tmp_path: Path) -> None:
    rc, text = _run_rank(tmp_path, "wait", signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert text is not None and _ends(text) == []


def test_a_rank_that_exported_nothing_writes_nothing(tmp_path: Path) -> None:
    for how in ("nothing", "nothing_wait"):
        rc, text = _run_rank(tmp_path, how, signal.SIGTERM if how == "nothing_wait" else None)
        assert text is None and not list(tmp_path.iterdir())


def test_end_reason_rules() -> None:
    with pytest.raises(ValueError, match="reason"):
        worker.mark_end("finished")
    assert worker.end_reason() == cat.END_CLEAN  # this process: nothing marked, no uncaught exception


def test_shutdown_twice_writes_the_end_once(tmp_path: Path) -> None:
    exp = PrometheusExporter(Identity("j", 0, 0, 1, "h"), http=False, sidecar_dir=tmp_path)
    exp.export(small_report())
    exp.shutdown()
    first = (tmp_path / "rank-0.prom").read_text()
    exp.shutdown()
    exp.export(small_report())  # after the end: not written
    assert (tmp_path / "rank-0.prom").read_text() == first
    assert [r for r, _ in _ends(first)] == [cat.END_CLEAN]
