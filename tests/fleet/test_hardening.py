"""Fleet hardening, probed as an operator and an attacker would: real sockets (loopback), real
files and FIFOs, a real SIGTERM. Each test is bounded in time; none needs torch but the last."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from fsdp_mem_otel.exporters.jsonl import JSONLExporter, read_reports
from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.fleet import serve
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.offline.run_index import scan_files
from tests.exporters import prom_workers
from tests.exporters.test_prometheus import big_report, samples, small_report, value

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = Identity("train", 0, 0, 1, "host")


def _scrape(url: str, context: object = None, timeout: float = 5.0) -> str:
    return prom_workers.get(url, context, timeout=timeout)  # type: ignore[arg-type]


# -- 1. the per-rank endpoint: a stuck client freezes nothing -------------------------------------
def test_tls_endpoint_serves_and_closes_while_a_client_stalls(tmp_path: Path) -> None:
    tls = prom_workers.make_tls(tmp_path)
    exp = PrometheusExporter(IDENTITY, port=0, addr="127.0.0.1", certfile=tls["cert"], keyfile=tls["key"])
    exp.export(small_report())
    stalled = socket.create_connection(("127.0.0.1", exp.port))  # connects, never starts the handshake
    half = socket.create_connection(("127.0.0.1", exp.port))
    half.sendall(b"\x16\x03\x01\x00\xff")  # the first bytes of a ClientHello, then nothing
    try:
        t0 = time.monotonic()
        text = _scrape(f"https://127.0.0.1:{exp.port}/metrics", prom_workers.client_context(tls, with_cert=False))
        assert time.monotonic() - t0 < 3.0
        assert value(text, "fsdp_mem_steps_total") == 7
        t0 = time.monotonic()
        exp.shutdown()  # the stalled clients are still connected
        assert time.monotonic() - t0 < 3.0
    finally:
        stalled.close()
        half.close()


def test_idle_connections_cost_no_thread_and_bursts_are_served() -> None:
    exp = PrometheusExporter(IDENTITY, port=0, addr="127.0.0.1")
    exp.export(small_report())
    url = f"http://127.0.0.1:{exp.port}/metrics"
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", exp.port)) for _ in range(300)]
    try:
        time.sleep(0.5)
        assert threading.active_count() - threads_before <= 4  # the worker pool at most
        assert value(_scrape(url), "fsdp_mem_steps_total") == 7  # served past 300 idle clients
        results: list[str] = []

        def scrape_once() -> None:
            try:
                results.append("ok" if "fsdp_mem_steps_total" in _scrape(url, timeout=20) else "bad")
            except OSError as exc:
                results.append(repr(exc))

        burst = [threading.Thread(target=scrape_once) for _ in range(100)]  # far past a backlog of 5
        for t in burst:
            t.start()
        for t in burst:
            t.join(30)
        assert results.count("ok") == 100, set(results)
    finally:
        for s in idle:
            s.close()
        exp.shutdown()


# -- 2. a stalled JSONL file system: bounded memory, a close with a deadline ---------------------
def test_stalled_file_system_bounds_memory_and_close(tmp_path: Path) -> None:
    fifo = tmp_path / "run.jsonl"
    os.mkfifo(fifo)  # a write that never completes: nobody reads, like a hung NFS mount
    exp = JSONLExporter(fifo, max_queue_bytes=8 * 1024 * 1024, index=False)
    template = big_report(64)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    try:
        for step in range(1, 301):  # ~0.6 MB each in memory: 180 MB if nothing were dropped
            report = copy.deepcopy(template)
            report.step = step
            exp.export(report)
        grown = proc.memory_info().rss - rss0
        assert grown < 60 * 1024 * 1024, grown
        assert exp.dropped_total >= 250 and exp.errors_total >= exp.dropped_total
        t0 = time.monotonic()
        exp.shutdown(timeout=2.0)
        assert time.monotonic() - t0 < 4.0
    finally:
        with open(fifo, "rb", buffering=0):  # release the writer stuck in open()
            pass


# -- 3./4./7. the sidecar trusts nothing in its directory -----------------------------------------
def _write_rank(directory: Path, rank: int) -> None:
    exp = PrometheusExporter(Identity("train", rank, rank, 8, "h"), http=False, sidecar_dir=directory)
    report = small_report()
    report.rank = rank
    exp.export(report)
    assert exp.flush()
    exp.shutdown()


def test_sidecar_refuses_links_fifos_devices_and_oversized_files(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "ranks"
    _write_rank(d, 0)
    secret = tmp_path / "secret.prom"  # valid exposition outside the directory, root-only
    secret.write_text('fsdp_mem_steps_total{job_name="SHADOW_SECRET"} 1\n')
    secret.chmod(0o600)
    (d / "rank-1.prom").symlink_to(secret)
    os.mkfifo(d / "rank-2.prom")
    (d / "rank-3.prom").symlink_to("/dev/zero")
    (d / "rank-4.prom").write_text("# just a comment, but far too long\n" * 100_000)  # 3.5 MB
    (d / "rank-5.prom").write_bytes(b"\xff\xfe not utf-8 at all")
    collector = serve.SidecarCollector(str(d), max_file_bytes=1024 * 1024)
    with caplog.at_level(logging.DEBUG):
        t0 = time.monotonic()
        text = collector.render().decode()
        assert time.monotonic() - t0 < 5.0  # no read of a FIFO or of /dev/zero
    assert "SHADOW_SECRET" not in text and "SHADOW_SECRET" not in caplog.text  # nothing of it served or logged
    assert {s.labels["rank"] for s in samples(text) if s.name == "fsdp_mem_steps_total"} == {"0"}
    assert value(text, "fsdp_mem_sidecar_refused_files_total", reason="not_regular") == 3
    assert value(text, "fsdp_mem_sidecar_refused_files_total", reason="too_large") == 1
    for rank in (1, 2, 3, 4, 5):
        assert value(text, "fsdp_mem_sidecar_read_errors_total", rank=str(rank)) == 1
        # every rank file seen keeps a freshness series, stale: no valid metrics from it (yet)
        assert value(text, "fsdp_mem_sidecar_rank_stale", rank=str(rank)) == 1
    assert value(text, "fsdp_mem_sidecar_rank_stale", rank="0") == 0


def test_sidecar_limits_the_number_of_files(tmp_path: Path) -> None:
    for rank in range(5):
        _write_rank(tmp_path, rank)
    text = serve.SidecarCollector(str(tmp_path), max_files=3).render().decode()
    assert {s.labels["rank"] for s in samples(text) if s.name == "fsdp_mem_steps_total"} == {"0", "1", "2"}
    assert value(text, "fsdp_mem_sidecar_refused_files_total", reason="too_many") == 2


def test_garbage_rewritten_goes_stale_heartbeats_keep_fresh(tmp_path: Path) -> None:
    _write_rank(tmp_path, 0)
    path = tmp_path / "rank-0.prom"
    good_mtime = os.stat(path).st_mtime
    now = [good_mtime + 5]
    collector = serve.SidecarCollector(str(tmp_path), stale_seconds=10, clock=lambda: now[0])
    assert value(collector.render().decode(), "fsdp_mem_sidecar_rank_stale", rank="0") == 0
    now[0] = good_mtime + 20
    os.utime(path, (now[0], now[0]))  # a heartbeat: same content, newer time
    assert value(collector.render().decode(), "fsdp_mem_sidecar_rank_stale", rank="0") == 0
    path.write_text("not exposition {{{\n")  # the rank now writes garbage, again and again
    for _ in range(3):
        now[0] += 8
        os.utime(path, (now[0], now[0]))
        text = collector.render().decode()
    assert value(text, "fsdp_mem_sidecar_rank_stale", rank="0") == 1
    assert value(text, "fsdp_mem_sidecar_rank_last_update_timestamp_seconds", rank="0") == good_mtime + 20


def test_unlistable_directory_is_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_rank(tmp_path, 0)
    collector = serve.SidecarCollector(str(tmp_path), stale_seconds=10)
    assert value(collector.render().decode(), "fsdp_mem_sidecar_directory_readable") == 1

    def refuse(path: str) -> list[str]:
        raise PermissionError(13, "Permission denied", path)  # a 0700 directory of another user

    monkeypatch.setattr(serve.os, "listdir", refuse)
    text = collector.render().decode()
    assert value(text, "fsdp_mem_sidecar_directory_readable") == 0
    assert value(text, "fsdp_mem_sidecar_rank_last_update_timestamp_seconds", rank="0") > 0  # still known


def test_existing_open_directory_is_made_owner_only(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)  # what a Kubernetes emptyDir looks like
    _write_rank(d, 0)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


# -- 5. SIGTERM: every exporter flushes, then the process ends as it would have ------------------
_PREEMPTED = textwrap.dedent("""
    import sys, time
    from fsdp_mem_otel.exporters.jsonl import JSONLExporter
    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
    from fsdp_mem_otel.identity import Identity
    from tests.exporters.test_prometheus import small_report
    out = sys.argv[1]
    jsonl = JSONLExporter(out + "/run.jsonl")
    prom = PrometheusExporter(Identity("train", 0, 0, 1, "h"), http=False, sidecar_dir=out + "/ranks")
    slow = jsonl._write_report
    jsonl._write_report = lambda r: (time.sleep(0.3), slow(r))  # a slow disk: lines still queued at SIGTERM
    for step in range(1, 6):
        report = small_report()
        report.step = step
        jsonl.export(report)
        prom.export(report)
    print("ready", flush=True)
    # Short sleeps, as a training loop keeps running bytecode: CPython runs a signal's Python handler
    # between bytecodes, so a SIGTERM that lands after "ready" but before one long sleep's system
    # call would wait the whole sleep out (1 run in 5 here: the handler never ran in time).
    for _ in range(600):
        time.sleep(0.1)
""")


def test_sigterm_flushes_every_exporter_then_terminates(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _PREEMPTED, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert time.monotonic() - t0 < 10
    assert rc == -signal.SIGTERM  # the default action, after the flush
    assert [r.step for r in read_reports(tmp_path / "run.jsonl")] == [1, 2, 3, 4, 5]  # nothing lost
    assert value((tmp_path / "ranks" / "rank-0.prom").read_text(), "fsdp_mem_steps_total") == 5


# -- 6. one bad line never fails a whole read ---------------------------------------------------------
def test_hostile_lines_are_skipped_with_a_warning(tmp_path: Path) -> None:
    good = [small_report().to_dict() for _ in range(2)]
    good[1]["step"] = 8
    huge = dict(good[0], step=0)
    path = tmp_path / "run.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps(good[0], sort_keys=True) + "\n")
        f.write(json.dumps(huge, sort_keys=True).replace('"step": 0', '"step": 1e400') + "\n")  # inf: no int
        f.write("[" * 100_000 + "]" * 100_000 + "\n")  # deeper than the parser goes
        f.write(json.dumps(good[1], sort_keys=True) + "\n")
    with pytest.warns(RuntimeWarning):
        assert [r.step for r in read_reports(path)] == [7, 8]
    with pytest.warns(RuntimeWarning):
        index = scan_files([str(path)])
    assert index.series[1].steps.tolist() == [7, 8]


# -- 8. installable without torch: the sidecar's slim image ----------------------------------------
def test_without_torch_the_sidecar_works_and_the_tracker_says_what_to_install(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # as in an image without torch: importing it fails
        from fsdp_mem_otel.cli import main
        from fsdp_mem_otel.fleet import serve, alerts, dashboards  # noqa: F401
        from fsdp_mem_otel.offline import report, jsonl_format  # noqa: F401
        import fsdp_mem_otel.exporters.prometheus, fsdp_mem_otel.exporters.jsonl  # noqa: F401
        try:
            import fsdp_mem_otel.training.tracker  # noqa: F401
        except ImportError as exc:
            print("TRACKER:", exc)
        sys.exit(main(["serve", "--help"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "fsdp-mem-otel[torch]" in out.stdout and "--dir" in out.stdout
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.split(">")[0].split("=")[0].strip() == "torch"]
    assert project["optional-dependencies"]["torch"] == ["torch>=2.13,<2.15"]


def test_real_scrape_of_the_sidecar_over_http(tmp_path: Path) -> None:
    _write_rank(tmp_path, 0)
    server = serve.make_server(str(tmp_path), 0, "127.0.0.1")
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=5) as r:
            assert r.status == 200
        assert value(_scrape(f"http://127.0.0.1:{server.port}/metrics"), "fsdp_mem_steps_total") == 7
    finally:
        server.stop()
