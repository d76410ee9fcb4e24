"""What the tracker costs in Python's cyclic garbage collector, tracked against untracked.

Light mode's entries are timed in place by ``hook_timing.py``; a collection that the tracker's
allocations trigger runs wherever the next allocation happens, and a full (generation 2)
collection, which objects surviving into the oldest generation bring on, costs far more than one
step's entries and comes every few dozen steps: a median over a few rounds can miss it. This
script counts instead, in one process (a world of one, gloo), over ``--steps`` steps: the
collections of each generation and the time they took (``gc.callbacks``), and, for one step
with the collector paused, the GC-tracked objects allocated (net of those freed) and those made
during the step that are still alive after it, by type:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gc_pressure.py --blocks 64 --steps 80

Run it with ``PYTHONPATH`` set to another version of the package to compare the two.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from fsdp_mem_otel.tools.demo import WrapOptions, build, init_distributed, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker


class Collections:
    """Collections per generation and their seconds, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


def exporters_reading_every_step(out: str) -> list[Any]:
    """``--exporters``: the JSONL file and the Prometheus sidecar, both every step (the sidecar
    renders each module's forward time from the report: its defaults render every 15 s)."""
    from fsdp_mem_otel.exporters.jsonl import JSONLExporter
    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
    from fsdp_mem_otel.identity import Identity

    identity = Identity("gc_pressure", 0, 0, 1, "host")
    return [JSONLExporter(os.path.join(out, "run.jsonl")),
            PrometheusExporter(identity, http=False, sidecar_dir=os.path.join(out, "sidecar"),
                               sidecar_interval_seconds=0.01)]


def run(blocks: int, steps: int, tracked: bool, exporters_dir: str | None = None) -> str:
    model, opt = build(blocks, 64, WrapOptions(fsdp=2))
    exporters = exporters_reading_every_step(exporters_dir) if exporters_dir and tracked else []
    tracker = FSDPMemoryTracker(model, opt, exporters=exporters).attach() if tracked else None

    def step(i: int) -> None:
        x = make_batch(i, 8, 64, 0)
        if tracker is not None:
            tracker.track_inputs(x)
        train_step(model, opt, x)
        if tracker is not None:
            tracker.step()

    for i in range(3):  # warm-up: optimizer state, first reports
        step(i)
    seen = Collections()
    gc.collect()
    gc.callbacks.append(seen)
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    wall = time.perf_counter() - t0
    gc.callbacks.remove(seen)
    gc.collect()
    gc.disable()
    before = {id(o) for o in gc.get_objects()}
    count0 = gc.get_count()[0]
    step(steps)
    allocated = gc.get_count()[0] - count0
    alive = collections.Counter(type(o).__name__ for o in gc.get_objects() if id(o) not in before)
    gc.enable()
    if tracker is not None:
        tracker.close()
    per_step = ", ".join(f"gen{g} {c / steps:.2f} ({c} in all, {s / steps * 1e6:.0f} us)"
                         for g, (c, s) in enumerate(zip(seen.count, seen.seconds, strict=True)))
    variant = ("light" + (" + exporters" if exporters else "")) if tracked else "untracked"
    return (f"{variant:9s} {blocks} blocks: step {wall / steps * 1e3:.1f} ms; "
            f"collections per step: {per_step}; total {sum(seen.seconds) / steps * 1e6:.0f} us/step\n"
            f"          one step: {allocated} GC-tracked objects allocated net, {sum(alive.values())} made and "
            f"still alive after it: {', '.join(f'{k} {v}' for k, v in alive.most_common(6))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--steps", type=int, default=80, help="steps counted (default 80: full collections are rare)")
    p.add_argument("--variant", choices=("both", "untracked", "light"), default="both",
                   help="both (default): each in a process of its own, so neither inherits the other's objects")
    p.add_argument("--exporters", action="store_true",
                   help="light: also export every step to a JSONL file and the Prometheus sidecar (in a "
                        "temporary directory), whose threads read each report in the same process")
    args = p.parse_args()
    for name in ("blocks", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    if args.variant == "both":
        for variant in ("untracked", "light"):
            subprocess.run([sys.executable, __file__, "--blocks", str(args.blocks), "--steps", str(args.steps),
                            "--variant", variant, *(["--exporters"] if args.exporters else [])], check=True)
        return
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    init_distributed()
    with tempfile.TemporaryDirectory() as out:
        print(run(args.blocks, args.steps, args.variant == "light", out if args.exporters else None), flush=True)


if __name__ == "__main__":
    main()
