"""The training thread's cost of handing a step's module reports over: ``StepRecorder.modules``.

Builds a recorder's log for one step of M FSDP modules (four forward and four backward states
each, their two peak windows, one device), then times ``modules`` (what ``tracker.step()`` calls
once per step): the walk that groups the log per module and computes each module's forward and
backward peak totals. Minimum over N calls, in one process:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recorder_modules.py [--modules 100] [--calls 2000]

Run it with ``PYTHONPATH`` set to another version of the package to compare the two.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import fsdp_mem_otel
from fsdp_mem_otel.schema import STATES, TEMP
from fsdp_mem_otel.training.light.ledger import Ledger
from fsdp_mem_otel.training.light.recorder import StepRecorder

FORWARD, BACKWARD = STATES[:4], STATES[4:8]  # a module's four forward and four backward states, in order


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modules", type=int, default=100)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    ledger = Ledger()
    recorder = StepRecorder(ledger)
    held = torch.empty(16)
    ledger.track(held, TEMP)  # one device in every snapshot, as in a job
    keys = [f"layers.{i}" for i in range(args.modules)]
    for key in keys:
        for state in FORWARD:
            recorder.on_state(key, state)
    for key in reversed(keys):
        for state in BACKWARD:
            recorder.on_state(key, state)
    best = float("inf")
    for _ in range(args.calls):
        t0 = time.perf_counter()
        recorder.modules  # noqa: B018 - the property is what is timed
        best = min(best, time.perf_counter() - t0)
    print(f"fsdp_mem_otel from {os.path.dirname(fsdp_mem_otel.__file__)}")
    print(f"StepRecorder.modules, {args.modules} FSDP modules: {best * 1e6:.0f} us (min of {args.calls} calls)")


if __name__ == "__main__":
    main()
