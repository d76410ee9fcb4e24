"""Soak: process memory growth over a long run, with and without the tracker.

Run (2 ranks, gloo, CPU):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/soak.py [--steps 2000] [--warmup 100]

Two variants, one after the other in the same processes, each on a freshly built demo model
(FSDP2, ``--blocks`` x ``--width``, Adam, a new batch of ``--batch`` rows every step):
``untracked`` (plain training) and ``tracked`` (``FSDPMemoryTracker(model, opt)`` attached in its
default light mode, ``track_inputs`` on every batch, ``tracker.step()`` after every optimizer
step, no exporters). ``--order`` picks which runs first.

Each variant is sampled at step ``--warmup`` and at its last step (and every ``--sample-every``
steps in between), after ``gc.collect()``, on every rank:

- ``rss``: process resident set size (psutil), bytes;
- ``blocks``: ``sys.getallocatedblocks()``, the Python objects' memory blocks alive (pymalloc
  and larger), a cheap proxy for the Python heap;
- ``gc_objects``: ``len(gc.get_objects())``, the objects the cyclic collector tracks;
- ``traced``: with ``--tracemalloc`` only (it slows every step down several times), tracemalloc
  is started right after the warm-up sample, so its current traced size is the bytes allocated
  since warm-up that are still alive. That includes the per-step objects that replaced older ones
  (a steady level, not growth), so its growth is counted from the first sample after warm-up
  (``--sample-every`` must be non-zero); the largest sources are printed at the end;
- the tracker's own tables (tracked variant): ``len(tracker.ledger)``, the optimizer tensors it
  holds as optimizer state, its open windows.

Prints, per rank, each figure at warm-up and at the end and its growth per 1,000 steps, side by
side for the two variants; ``--json PATH`` also writes every sample (rank 0 writes it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import tracemalloc
from typing import Any

import psutil
import torch
import torch.distributed as dist

from fsdp_mem_otel.checks import int_at_least
from fsdp_mem_otel.tools.demo import WrapOptions, build, init_distributed, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

VARIANTS = ("untracked", "tracked")
#: figures every sample has, with how the table prints them
FIGURES = (("rss", "RSS (MiB)", 2**20), ("blocks", "allocated blocks", 1), ("gc_objects", "gc objects", 1))
TABLES = ("ledger", "opt_tensors", "open_windows")


def _tables(tracker: FSDPMemoryTracker | None) -> dict[str, int]:
    """The tracker's own tables (those that must not grow with the number of steps)."""
    if tracker is None:
        return {}
    out: dict[str, int] = {}
    for name, read in (("ledger", lambda: len(tracker.ledger)),
                       ("opt_tensors", lambda: tracker._optimizers._state_tensors),
                       ("open_windows", lambda: tracker.ledger.open_windows)):
        try:  # private attributes: tolerate a tracker that renamed them
            out[name] = int(read())
        except Exception:  # noqa: BLE001
            pass
    return out


def _sample(step: int, proc: psutil.Process, tracker: FSDPMemoryTracker | None, t0: float) -> dict[str, Any]:
    dist.barrier()
    gc.collect()
    s: dict[str, Any] = {
        "step": step,
        "seconds": time.perf_counter() - t0,
        "rss": proc.memory_info().rss,
        "blocks": sys.getallocatedblocks(),
        "gc_objects": len(gc.get_objects()),
    }
    if tracemalloc.is_tracing():
        s["traced"] = tracemalloc.get_traced_memory()[0]
    s.update(_tables(tracker))
    if tracker is not None:
        s["errors"] = tracker.errors_total
    return s


def _short(filename: str) -> str:
    """A traceback file name relative to site-packages or to the working directory."""
    return filename.split("site-packages/")[-1] if "site-packages/" in filename else os.path.relpath(filename)


def run_variant(name: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Train ``args.steps`` steps of a fresh model under ``name``; returns its samples."""
    proc = psutil.Process()
    model, opt = build(args.blocks, args.width, WrapOptions(fsdp=2))
    tracker = FSDPMemoryTracker(model, opt, mode="light", deep_every=0).attach() if name == "tracked" else None
    on_inputs = tracker.track_inputs if tracker is not None else None
    marks = {args.warmup, args.steps}
    if args.sample_every:
        marks.update(range(args.warmup + args.sample_every, args.steps, args.sample_every))
    samples: list[dict[str, Any]] = []
    top: list[str] = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = make_batch(step, args.batch, args.width, rank)
        train_step(model, opt, x, on_inputs=on_inputs)
        if tracker is not None:
            tracker.step()
        del x
        if step in marks:
            samples.append(_sample(step, proc, tracker, t0))
            if step == args.warmup and args.tracemalloc:
                tracemalloc.start(args.tracemalloc_frames)
    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot()
        tracemalloc.stop()
        for stat in snap.statistics("traceback")[: args.top]:
            frames = " <- ".join(f"{_short(f.filename)}:{f.lineno}" for f in stat.traceback)
            top.append(f"{stat.size / 2**10:9.1f} KiB {stat.count:6d} blocks  {frames}")
        del snap
    if tracker is not None:
        tracker.close()
    del model, opt, tracker, on_inputs
    gc.collect()
    dist.barrier()
    return {"variant": name, "samples": samples, "top_traced": top}


def growth(res: dict[str, Any], key: str) -> tuple[float, float, float, int] | None:
    """(first value, value at the end, growth per 1,000 steps, step of the first value) of ``key``
    from the first sample that has it (warm-up; for ``traced``, the first sample after warm-up),
    or None where it was sampled fewer than twice."""
    have = [s for s in res["samples"] if key in s]
    if len(have) < 2:
        return None
    first, last = have[0], have[-1]
    return first[key], last[key], (last[key] - first[key]) * 1000 / (last["step"] - first["step"]), first["step"]


def print_table(per_rank: list[dict[str, dict[str, Any]]], order: list[str]) -> None:
    keys = [*FIGURES]
    traced_from = {g[3] for r in per_rank for v in order if (g := growth(r[v], "traced")) is not None}
    if traced_from:
        keys.append(("traced", f"traced KiB (from {'/'.join(map(str, sorted(traced_from)))})", 2**10))
    keys += [(t, f"tracker {t}", 1) for t in TABLES]
    cols = [f"{v} {c}" for v in order for c in ("warm-up", "end", "per 1k")]
    print(f"{'rank':<4} {'figure':<28} " + " ".join(f"{c:>17}" for c in cols))
    for rank, res in enumerate(per_rank):
        for key, label, unit in keys:
            cells = []
            for v in order:
                g = growth(res[v], key)
                if g is None:
                    cells += ["-", "-", "-"]
                    continue
                w, e, per = g[0] / unit, g[1] / unit, g[2] / unit
                fmt = ".1f" if unit > 1 else ".0f"
                cells += [f"{w:{fmt}}", f"{e:{fmt}}", f"{per:+{fmt}}"]
            if all(c == "-" for c in cells):
                continue
            print(f"{rank:<4} {label:<28} " + " ".join(f"{c:>17}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int_at_least(2), default=2000, help="steps per variant (default 2000)")
    p.add_argument("--warmup", type=int_at_least(1), default=100,
                   help="step of the first sample, growth is measured from it (default 100)")
    p.add_argument("--blocks", type=int_at_least(1), default=4, help="residual blocks (default 4, the demo's)")
    p.add_argument("--width", type=int_at_least(1), default=64, help="block width (default 64, the demo's)")
    p.add_argument("--batch", type=int_at_least(1), default=32, help="batch rows per rank (default 32, the demo's)")
    p.add_argument("--sample-every", type=int_at_least(0), default=500,
                   help="also sample every N steps after warm-up (default 500; 0 = warm-up and end only)")
    p.add_argument("--order", default=",".join(VARIANTS), help="variants in the order they run (default "
                   "untracked,tracked)")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace Python allocations from warm-up on (slow): bytes allocated since and still alive")
    p.add_argument("--tracemalloc-frames", type=int_at_least(1), default=3, help="frames per traceback (default 3)")
    p.add_argument("--top", type=int_at_least(0), default=8, help="largest traced sources to print (default 8)")
    p.add_argument("--json", default=None, help="also write every sample to this JSON file (rank 0)")
    args = p.parse_args(argv)
    order = [v for v in args.order.split(",") if v]
    if sorted(order) != sorted(VARIANTS):
        p.error(f"--order: a permutation of {','.join(VARIANTS)}; got {args.order!r}")
    if args.warmup >= args.steps:
        p.error("--warmup must be below --steps")
    if args.tracemalloc and not args.sample_every:
        p.error("--tracemalloc needs --sample-every > 0 (its growth starts at the first sample after warm-up)")
    rank, world = init_distributed()

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    mine: dict[str, dict[str, Any]] = {}
    for v in order:
        log(f"  {v}: {args.steps} steps ...")
        mine[v] = run_variant(v, args, rank)
        last = mine[v]["samples"][-1]
        log(f"  {v}: done in {last['seconds']:.1f} s ({last['seconds'] / args.steps * 1e3:.1f} ms/step)")
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        print(f"world_size={world} torch={torch.__version__} steps={args.steps} warmup={args.warmup} "
              f"model: FSDP2 {args.blocks} blocks x width {args.width}, batch {args.batch}; "
              f"order: {', '.join(order)}; tracemalloc: {'on' if args.tracemalloc else 'off'}")
        for v in order:
            secs = [r[v]["samples"][-1]["seconds"] for r in per_rank]
            print(f"{v}: {max(secs):.1f} s for {args.steps} steps ({max(secs) / args.steps * 1e3:.1f} ms/step)"
                  + (f", tracker errors {per_rank[0][v]['samples'][-1].get('errors', 0)}" if v == "tracked" else ""))
        print(f"growth from step {args.warmup} to step {args.steps}, per 1,000 steps (after gc.collect()):")
        print_table(per_rank, order)
        for r, res in enumerate(per_rank):
            for v in order:
                if res[v]["top_traced"]:
                    print(f"rank {r} {v}: largest allocations made since warm-up and still alive at the end:")
                    print("  " + "\n  ".join(res[v]["top_traced"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world_size": world, "torch": torch.__version__,
                           "ranks": per_rank}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
