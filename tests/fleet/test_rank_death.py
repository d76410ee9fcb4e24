"""kill -9 one of two ranks mid-run: the sidecar keeps serving the survivor and marks the dead
rank stale, and the survivor's own endpoint keeps answering."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.dist import free_ports

STALE_SECONDS = 3.0


def _rank(rank: int, port: int, metrics_port: int, sidecar: str, progress: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
    from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, opt = build(2, 32, WrapOptions(fsdp=2))
    exporter = PrometheusExporter(base_port=metrics_port, addr="127.0.0.1", sidecar_dir=sidecar,
                                  heartbeat_seconds=0.5, sidecar_interval_seconds=0.2)
    tracker = FSDPMemoryTracker(model, opt, exporters=[exporter]).attach()
    step = 0
    try:
        while True:  # until killed
            train_step(model, opt, make_batch(step, 8, 32, rank))
            tracker.step()
            step += 1
            Path(progress, f"rank{rank}").write_text(str(step))
    except RuntimeError:  # gloo: the peer is gone. Stay up, as a rank awaiting teardown does.
        time.sleep(600)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _value(text: str, name: str, rank: int) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'rank="{rank}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for rank {rank} not found in:\n{text}")


def test_killed_rank_goes_stale_and_survivor_keeps_answering(tmp_path: Path) -> None:
    from fsdp_mem_otel.fleet.serve import make_server

    sidecar, progress = tmp_path / "sidecar", tmp_path / "progress"
    progress.mkdir()
    ctx = mp.get_context("spawn")
    port, metrics_port = free_ports(), free_ports()
    procs = [ctx.Process(target=_rank, args=(r, port, metrics_port, str(sidecar), str(progress))) for r in (0, 1)]
    for p in procs:
        p.start()
    server: Any = None
    try:
        deadline = time.monotonic() + 120
        while not all((progress / f"rank{r}").exists() and int((progress / f"rank{r}").read_text() or 0) >= 3
                      for r in (0, 1)):
            assert time.monotonic() < deadline, "ranks did not start training"
            assert all(p.is_alive() for p in procs)
            time.sleep(0.2)
        server = make_server(str(sidecar), 0, "127.0.0.1", stale_seconds=STALE_SECONDS)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        sidecar_url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        before = _scrape(sidecar_url)
        while _value(before, "fsdp_mem_steps_total", 1) < 3:  # rank files are rewritten every 0.2 s at most
            assert time.monotonic() < deadline, "rank 1's file never reached step 3"
            time.sleep(0.1)
            before = _scrape(sidecar_url)
        assert _value(before, "fsdp_mem_sidecar_rank_stale", 0) == 0
        assert _value(before, "fsdp_mem_sidecar_rank_stale", 1) == 0

        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(10)
        time.sleep(STALE_SECONDS + 2)

        after = _scrape(sidecar_url)
        assert _value(after, "fsdp_mem_sidecar_rank_stale", 1) == 1  # dead rank marked stale
        assert _value(after, "fsdp_mem_sidecar_rank_stale", 0) == 0  # survivor fresh (heartbeat)
        assert _value(after, "fsdp_mem_steps_total", 1) >= 3  # dead rank's last values still served
        survivor = _scrape(f"http://127.0.0.1:{metrics_port}/metrics")  # rank 0's own endpoint
        assert _value(survivor, "fsdp_mem_steps_total", 0) >= 3
        assert procs[0].is_alive()
    finally:
        if server is not None:
            server.shutdown()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
