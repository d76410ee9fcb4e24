"""What a reader of a light step's module snapshots pays: every module's counters read right after
``tracker.step()`` (one process, a world of one, FSDP2 demo model), median over 50 steps.

    OMP_NUM_THREADS=1 PYTHONPATH=$TREE python reader_cost.py 16   # or 64
"""

import os
import statistics
import sys
import time

from fsdp_mem_otel.tools.demo import WrapOptions, build, init_distributed, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29537")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")


def main() -> None:
    blocks = int(sys.argv[1])
    rank, _ = init_distributed()
    model, opt = build(blocks, 64, WrapOptions(fsdp=2))
    tracker = FSDPMemoryTracker(model, opt, mode="light").attach()
    reads = []
    for step in range(60):
        train_step(model, opt, make_batch(step, 8, 64, rank))
        report = tracker.step()
        t0 = time.perf_counter()
        for mod in report.modules.values():
            mod.counters  # noqa: B018 - the read is the point
        if step >= 10:
            reads.append(time.perf_counter() - t0)
    print(f"blocks={blocks}: first read of every module's counters: median {statistics.median(reads) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
