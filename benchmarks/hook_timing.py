"""Where light mode's cost goes: the tracker's own entry points timed in place during training.

Run (2 ranks, gloo, CPU):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/hook_timing.py [--blocks 16] [--steps 30]

Every function through which training enters the tracker is wrapped with a timer before attach:
the forward hooks (``on_state``), FSDP2 param-group wrappers (named after the tracker function
they run), the saved-tensor pack hook, the ledger's free callbacks, the optimizer hooks and
``step()``. Only the outermost entry is timed, so nested calls count once. The timers add about
a microsecond per call of their own. Printed per step: time and calls per entry point, and their
sum as a share of the untracked step's training-thread CPU time measured just before.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import fsdp_mem_otel.adapters.fsdp2 as fsdp2
import fsdp_mem_otel.ledger as ledger
import fsdp_mem_otel.tracker as tracker_module
from fsdp_mem_otel.demo import WrapOptions, build, init_distributed, make_batch, train_step

TIMES: collections.Counter[str] = collections.Counter()
CALLS: collections.Counter[str] = collections.Counter()
_depth = [0]


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _depth[0]:
            return fn(*args, **kwargs)
        _depth[0] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
            CALLS[name] += 1
            _depth[0] -= 1

    return wrapper


def instrument() -> None:
    cls = tracker_module.FSDPMemoryTracker
    for name in ("on_state", "step"):
        setattr(cls, name, timed(name, getattr(cls, name)))
    import fsdp_mem_otel.optimizers as optimizers

    for name in ("_on_pre", "_on_post"):
        setattr(optimizers.OptimizerWatch, name, timed("optimizer hooks", getattr(optimizers.OptimizerWatch, name)))
    import fsdp_mem_otel.activations as activations

    activations.SavedTensorAccounting._pack = timed("saved-tensor pack", activations.SavedTensorAccounting._pack)
    guarded = fsdp2._guarded

    def named_guarded(sink: Any, fn: Callable[[], None]) -> None:
        timed("group:" + getattr(fn, "__name__", "?"), guarded)(sink, fn)

    fsdp2._guarded = named_guarded
    free_callback = ledger._free_callback
    ledger._free_callback = lambda entries, ref: timed("weakref free", free_callback(entries, ref))  # type: ignore


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    rank, _ = init_distributed()
    model, opt = build(args.blocks, 64, WrapOptions(fsdp=2))
    xs = [make_batch(i, 8, 64, rank) for i in range(args.steps)]

    def run(tracker: Any) -> float:
        cpu = []
        for x in xs:
            dist.barrier()
            c0 = time.thread_time()
            if tracker is not None:
                tracker.track_inputs(x)
            train_step(model, opt, x)
            if tracker is not None:
                tracker.step()
            cpu.append(time.thread_time() - c0)
        return statistics.median(cpu)

    run(None)
    base = run(None)
    instrument()
    tracker = tracker_module.FSDPMemoryTracker(model, opt)
    with tracker:
        run(tracker)  # warm-up: optimizer state, first entries
        TIMES.clear()
        CALLS.clear()
        run(tracker)
    if rank == 0:
        per_step = sum(TIMES.values()) / args.steps
        print(f"dispatch-{args.blocks}: untracked step {base * 1e3:.2f} ms CPU; tracker in place "
              f"{per_step * 1e3:.3f} ms/step = {per_step / base:.2%}")
        print(f"{'entry point':<34} {'us/step':>9} {'calls/step':>11} {'share':>7}")
        for name, t in TIMES.most_common():
            print(f"{name:<34} {t / args.steps * 1e6:9.1f} {CALLS[name] / args.steps:11.1f} "
                  f"{t / args.steps / base:7.2%}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
