"""``fsdp-mem-otel serve``: merging rank files, freshness, bad files, TLS, and the command itself.

The real 2-rank run through the sidecar is in test_prometheus.py (it shares that run's spawn).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.fleet import serve
from fsdp_mem_otel.identity import Identity
from tests.dist import free_ports
from tests.exporters import prom_workers
from tests.exporters.test_prometheus import big_report, promtool_check, samples, small_report, value


def write_ranks(directory: Path, world: int = 2) -> list[PrometheusExporter]:
    exps = []
    for r in range(world):
        exp = PrometheusExporter(Identity("train", r, r, world, "h"), http=False, sidecar_dir=directory)
        report = small_report()
        report.rank = r
        report.peak = {"cuda:0": {**report.peak["cuda:0"], "total": 1000 * (r + 1)}}
        exp.export(report)
        assert exp.flush()
        exps.append(exp)
    return exps


def scrape(collector: serve.SidecarCollector) -> str:
    return collector.render().decode()


def test_merges_families_once_with_every_rank(tmp_path: Path) -> None:
    exps = write_ranks(tmp_path)
    (tmp_path / "notes.txt").write_text("not a rank file")
    (tmp_path / ".rank-0.prom.x1.tmp").write_text("half a fi")  # a writer's temp file: ignored
    text = scrape(serve.SidecarCollector(str(tmp_path)))
    promtool_check(text)
    for line in (x for x in text.splitlines() if x.startswith("# TYPE")):
        assert text.count(line + "\n") == 1, line
    for r in range(2):
        assert value(text, "fsdp_mem_step_peak_bytes", rank=str(r), category="total") == 1000 * (r + 1)
        assert value(text, "fsdp_mem_sidecar_rank_stale", rank=str(r), job_name="train", world_size="2") == 0
        mtime = os.stat(tmp_path / f"rank-{r}.prom").st_mtime
        assert value(text, "fsdp_mem_sidecar_rank_last_update_timestamp_seconds", rank=str(r)) == mtime
    # the merged samples are exactly the union of the rank files' samples
    per_rank = [s for r in range(2) for s in samples((tmp_path / f"rank-{r}.prom").read_text())]
    merged = [s for s in samples(text) if not s.name.startswith("fsdp_mem_sidecar_")]
    assert sorted(map(repr, merged)) == sorted(map(repr, per_rank))
    for e in exps:
        e.shutdown()


def test_stale_after_window_and_back(tmp_path: Path) -> None:
    write_ranks(tmp_path)
    mtime = os.stat(tmp_path / "rank-1.prom").st_mtime
    now = [mtime + 5.0]
    collector = serve.SidecarCollector(str(tmp_path), stale_seconds=10.0, clock=lambda: now[0])
    assert value(scrape(collector), "fsdp_mem_sidecar_rank_stale", rank="1") == 0
    now[0] = mtime + 10.5
    text = scrape(collector)
    assert value(text, "fsdp_mem_sidecar_rank_stale", rank="1") == 1
    assert value(text, "fsdp_mem_step_peak_bytes", rank="1", category="total") == 2000  # last known values stay
    os.utime(tmp_path / "rank-1.prom", (now[0], now[0]))  # the rank writes again
    assert value(scrape(collector), "fsdp_mem_sidecar_rank_stale", rank="1") == 0


def test_bad_duplicate_and_vanished_files(tmp_path: Path) -> None:
    write_ranks(tmp_path)
    (tmp_path / "rank-7.prom").write_text("fsdp_mem_x{ this is not exposition\n")
    collector = serve.SidecarCollector(str(tmp_path))
    text = scrape(collector)
    promtool_check(text)
    assert value(text, "fsdp_mem_sidecar_read_errors_total", rank="7") == 1
    # shown, and stale: a rank is fresh only by a file that parsed (node_exporter's rule), so a
    # rank that keeps rewriting garbage cannot pass for alive
    assert value(text, "fsdp_mem_sidecar_rank_stale", rank="7") == 1
    assert value(text, "fsdp_mem_step_peak_bytes", rank="0", category="total") == 1000  # the others unharmed
    # two files claiming the same series: served once (Prometheus rejects duplicate series)
    (tmp_path / "rank-7.prom").write_bytes((tmp_path / "rank-0.prom").read_bytes())
    text = scrape(collector)
    assert value(text, "fsdp_mem_step_peak_bytes", rank="0", category="total") == 1000
    (tmp_path / "rank-7.prom").unlink()
    (tmp_path / "rank-1.prom").unlink()
    text = scrape(collector)
    assert {s.labels["rank"] for s in samples(text) if s.name == "fsdp_mem_sidecar_rank_stale"} == {"0"}
    assert not [s for s in samples(text) if s.labels.get("rank") == "1"]
    missing = serve.SidecarCollector(str(tmp_path / "not-yet"))  # directory not created yet: no error
    assert not samples(scrape(missing))


def test_never_serves_half_a_file(tmp_path: Path) -> None:
    exp = PrometheusExporter(Identity("j", 0, 0, 1, "h"), http=False, sidecar_dir=tmp_path, detail=True)
    report = big_report(4)
    exp.export(report)
    assert exp.flush()
    expected = (tmp_path / "rank-0.prom").read_text()
    server = serve.make_server(str(tmp_path), 0, "127.0.0.1")
    server.start()
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            exp.export(report)
            exp.flush()

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(6):
            text = prom_workers.get(f"http://127.0.0.1:{server.port}/metrics")
            assert text.startswith(expected)  # the whole rank file, then the sidecar's own series
    finally:
        stop.set()
        t.join()
        server.stop()
        exp.shutdown()


def test_mutual_tls(tmp_path: Path) -> None:
    tls = prom_workers.make_tls(tmp_path)
    data = tmp_path / "d"
    write_ranks(data)
    server = serve.make_server(str(data), 0, "127.0.0.1", certfile=tls["cert"], keyfile=tls["key"],
                               client_cafile=tls["ca"], stale_seconds=60)
    server.start()
    url = f"https://127.0.0.1:{server.port}/metrics"
    try:
        assert prom_workers.try_get(url, prom_workers.client_context(tls, with_cert=False)) != "ok"
        assert prom_workers.try_get(url.replace("https", "http")) != "ok"
        text = prom_workers.get(url, prom_workers.client_context(tls))  # still serving after the refusals
        assert value(text, "fsdp_mem_step_peak_bytes", rank="1", category="total") == 2000
    finally:
        server.stop()
    with pytest.raises(ValueError, match="client_cafile"):
        serve.make_server(str(data), 0, "127.0.0.1", client_cafile=tls["ca"])


def test_serve_command(tmp_path: Path) -> None:
    write_ranks(tmp_path)
    port = free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_mem_otel.fleet.serve", "--dir", str(tmp_path), "--port", str(port),
         "--addr", "127.0.0.1", "--stale-seconds", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while prom_workers.try_get(f"http://127.0.0.1:{port}/metrics") != "ok":
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)
        time.sleep(0.6)  # nobody writes: both ranks go stale
        text = prom_workers.get(f"http://127.0.0.1:{port}/metrics")
        assert value(text, "fsdp_mem_sidecar_rank_stale", rank="0") == 1
        assert value(text, "fsdp_mem_sidecar_rank_stale", rank="1") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def test_serve_main_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--dir", "d"], ["--dir", "d", "--port", "1", "--certfile", "c.pem"],
                 ["--dir", "d", "--port", "1", "--stale-seconds", "0"], ["--dir", "d", "--port", "99999"]):
        with pytest.raises(SystemExit) as exc:
            serve.serve_main(argv)
        assert exc.value.code == 2
    assert "--stale-seconds" in capsys.readouterr().err


def _end_ranks(directory: Path) -> None:
    """Rank 0 runs; rank 1 ran and closed (its last file records a clean end)."""
    exps = write_ranks(directory)
    exps[1].shutdown()


def test_an_ended_rank_is_not_stale_and_is_served_for_ended_seconds(tmp_path: Path) -> None:
    _end_ranks(tmp_path)
    mtime = os.stat(tmp_path / "rank-1.prom").st_mtime
    now = [mtime + 20.0]
    collector = serve.SidecarCollector(str(tmp_path), stale_seconds=10.0, ended_seconds=30.0, clock=lambda: now[0])
    text = scrape(collector)
    promtool_check(text)
    assert value(text, "fsdp_mem_sidecar_rank_stale", rank="0") == 1  # silent for 20 s, no end: stale
    assert value(text, "fsdp_mem_sidecar_rank_stale", rank="1") == 0  # ended: not stale
    assert value(text, "fsdp_mem_rank_end_timestamp_seconds", rank="1", reason="clean") >= mtime - 1
    assert value(text, "fsdp_mem_step_peak_bytes", rank="1", category="total") == 2000
    now[0] = mtime + 31.0  # past --ended-seconds: the ended rank's series end, the silent one stays
    text = scrape(collector)
    assert {s.labels["rank"] for s in samples(text) if s.labels.get("rank")} == {"0"}
    assert value(text, "fsdp_mem_sidecar_rank_stale", rank="0") == 1
    # a new run of rank 1 rewrites its file without an end: served again
    write_ranks(tmp_path)
    now[0] = os.stat(tmp_path / "rank-1.prom").st_mtime + 1.0
    text = scrape(collector)
    assert value(text, "fsdp_mem_sidecar_rank_stale", rank="1") == 0
    assert not [s for s in samples(text) if s.name == "fsdp_mem_rank_end_timestamp_seconds"]


def test_a_restarted_sidecar_serves_the_same_series_and_counters(tmp_path: Path) -> None:
    exps = write_ranks(tmp_path)
    before = [s for s in samples(scrape(serve.SidecarCollector(str(tmp_path))))]
    after = [s for s in samples(scrape(serve.SidecarCollector(str(tmp_path))))]  # a new process: no state
    assert sorted(map(repr, after)) == sorted(map(repr, before))
    assert [s.value for s in after if s.name == "fsdp_mem_steps_total"] == [small_report().step] * 2
    for e in exps:
        e.shutdown()


def _serve(directory: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_mem_otel.fleet.serve", "--dir", str(directory), "--port", str(port),
         "--addr", "127.0.0.1", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while prom_workers.try_get(f"http://127.0.0.1:{port}/") != "ok":  # the banner: not a scrape
        assert proc.poll() is None and time.monotonic() < deadline, "serve did not come up"
        time.sleep(0.1)
    return proc


def test_sigterm_keeps_serving_until_an_ended_rank_was_scraped(tmp_path: Path) -> None:
    write_ranks(tmp_path)
    port = free_ports(1)
    proc = _serve(tmp_path, port, "--drain-seconds", "30", "--stale-seconds", "0.5")
    try:
        exp = PrometheusExporter(Identity("train", 2, 0, 3, "h"), http=False, sidecar_dir=tmp_path)
        exp.export(small_report())
        exp.shutdown()  # rank 2 ends after the last scrape: its end has not been served yet
        proc.send_signal(signal.SIGTERM)
        time.sleep(2.5)
        assert proc.poll() is None, "stopped before the ended rank was scraped"
        text = prom_workers.get(f"http://127.0.0.1:{port}/metrics")  # the scrape that was waited for
        assert value(text, "fsdp_mem_rank_end_timestamp_seconds", rank="2", reason="clean") > 0
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 5
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_sigterm_with_nothing_to_deliver_stops_at_once_and_drain_is_bounded(tmp_path: Path) -> None:
    write_ranks(tmp_path)  # no end: nothing to wait for (they are stale at once)
    proc = _serve(tmp_path, free_ports(1), "--drain-seconds", "30", "--stale-seconds", "0.5")
    time.sleep(0.6)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and time.monotonic() - t0 < 5, out
    exp = PrometheusExporter(Identity("train", 2, 0, 3, "h"), http=False, sidecar_dir=tmp_path)
    exp.export(small_report())
    exp.shutdown()
    proc = _serve(tmp_path, free_ports(1), "--drain-seconds", "3", "--stale-seconds", "0.5")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # rank 2's end is never scraped: it stops at the bound
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and 2.5 < time.monotonic() - t0 < 8, out
    assert "stopping before ranks [2] were scraped" in out
