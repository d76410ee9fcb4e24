"""exporter_cpu.py with the collector's collections counted in each replay (a throw-away wrapper).

    OMP_NUM_THREADS=1 [PYTHONPATH=$TREE] .venv/bin/python \
        benchmarks/results/gc-invisible-snapshots-2026-11-26/exporter_cpu_gc_counts.py

Prints, per replay (one exporter, or all three), its CPU per step, the collections per generation
and their milliseconds per step.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import exporter_cpu  # noqa: E402

counts = [0, 0, 0]
seconds = [0.0, 0.0, 0.0]
started = [0.0]


def on_collection(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        counts[info["generation"]] += 1
        seconds[info["generation"]] += time.perf_counter() - started[0]


replay_once = exporter_cpu.replay


def replay(reports: list[Any], exporters: list[Any], *args: Any) -> float:
    counts[:] = [0, 0, 0]
    seconds[:] = [0.0, 0.0, 0.0]
    cpu = replay_once(reports, exporters, *args)
    per_step = [round(s * 1e3 / len(reports), 3) for s in seconds]
    print(f"{len(exporters)} exporters {cpu * 1e3:.3f} ms/step; gc {counts} {per_step} ms/step", flush=True)
    return cpu


if __name__ == "__main__":
    gc.callbacks.append(on_collection)
    exporter_cpu.replay = replay
    sys.argv = ["exporter_cpu.py", "--steps", "300", "--modules", "100", "--rounds", "2"]
    exporter_cpu.main()
