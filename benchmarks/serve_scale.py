"""The sidecar (`fsdp-mem-otel serve`) at pod scale: scrape latency and memory.

Writes R rank files through the real PrometheusExporter (every state of every module on two
devices, M modules), starts `fsdp-mem-otel serve` on them as its own process, scrapes it N times
over HTTP and prints the median and p95 scrape latency, the page size and serve's peak RSS
(VmHWM), with detail off and on.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_scale.py --ranks 8 --modules 256 --scrapes 50
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import CATEGORY_KEYS, STATES, ModuleReport, StepReport


def report(rank: int, modules: int) -> StepReport:
    b = {dev: {c: 1000 * (rank + 1) + i for i, c in enumerate(CATEGORY_KEYS)} for dev in ("cuda:0", "cpu")}
    keys = ["<root>"] + [f"layers.{i}" for i in range(modules - 1)]
    mods = {k: ModuleReport({s: [b] for s in STATES}, {s: [10, 20] for s in STATES}) for k in keys}
    return StepReport(step=1, rank=rank, world_size=8, mode="light", fsdp_version=2, peak=b, modules=mods,
                      module_order=keys, current=b, allocator={"cuda:0": {"allocated_bytes": 1.0}})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(ranks: int, modules: int, scrapes: int, detail: bool) -> tuple[float, float, int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "ranks")
        for r in range(ranks):
            exp = PrometheusExporter(Identity("bench", r, r, ranks, "host"), http=False, sidecar_dir=directory,
                                     detail=detail)
            exp.export(report(r, modules))
            exp.flush(timeout=60)
            exp.shutdown()
        port = free_port()
        cmd = [sys.executable, "-m", "fsdp_mem_otel.cli", "serve", "--dir", directory, "--port", str(port),
               "--addr", "127.0.0.1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(url, timeout=10).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            times, size = [], 0
            for _ in range(scrapes):
                t0 = time.perf_counter()
                size = len(urllib.request.urlopen(url, timeout=30).read())
                times.append(time.perf_counter() - t0)
            times.sort()
            return statistics.median(times), times[int(0.95 * (len(times) - 1))], size, peak_rss(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--modules", type=int, default=256)
    p.add_argument("--scrapes", type=int, default=50)
    args = p.parse_args()
    print(f"{args.ranks} rank files x {args.modules} modules, {args.scrapes} scrapes each\n")
    print("| detail | page size | scrape median | scrape p95 | serve peak RSS |")
    print("|---|---|---|---|---|")
    for detail in (False, True):
        med, p95, size, rss = measure(args.ranks, args.modules, args.scrapes, detail)
        print(f"| {'on (top-8)' if detail else 'off'} | {size / 1e6:.2f} MB | {med * 1e3:.1f} ms | "
              f"{p95 * 1e3:.1f} ms | {rss / 2**20:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
