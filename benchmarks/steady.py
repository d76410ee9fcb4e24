"""Light mode's whole-run cost in steady state: the tracker attached for the whole run, as in training.

Run (2 ranks, gloo, CPU):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/steady.py [--models dispatch-16,dispatch-64,compute-4]
        [--rounds 61] [--steps 2] [--warmup 40] [--json PATH] [--aa]

Each model is built twice with the same initial weights, both copies wrapped with FSDP2 on the
same process group: one is tracked (light mode, this tree's defaults) from its warm-up to the
end, the other never is. Rounds alternate between the copies, ``--steps`` steps each (the
untracked copy first in odd rounds, the tracked one first in even rounds), every step on a batch
of its own, as a data loader gives them, so the tracker replays the steps that repeat and learns
one in 17 to check, as it does in a long run. Per round and copy: the median training-thread
CPU time of its steps (``track_inputs``, the step and ``tracker.step()``, as overhead.py times
them) and the median wall time from barrier to barrier. A round's ratio is the tracked copy's
over the untracked one's: short rounds pair steps a second or less apart, so the machine's drift
(here the same step's CPU time moves by 20% within minutes) hits both copies alike; printed per
model: the median over rounds of those ratios (the figure
the targets are about: 1.03x on the dispatch-bound models, 1.01x on the compute-bound one), their
range, and what the tracker did in the timed steps (replayed, learnt, replays that missed).
``--aa`` detaches the tracker after the warm-up, so both copies train untracked: the ratios then
show what the method reads on its own.

``overhead.py`` attaches each variant's tracker anew in every round, so the first two of each
round's steps learn (a run learns twice once, at its start) and, as the same batches come back
every round, a step can miss its script: it times what the tracker costs around an attach, which
this script leaves out. Both run the same training step on the same models.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdp_mem_otel.tools.demo import WrapOptions, build, init_distributed, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

#: blocks, width, batch: overhead.py's models
MODELS = {
    "dispatch-16": (16, 64, 8),
    "dispatch-64": (64, 64, 8),
    "compute-4": (4, 1024, 256),
}
TARGETS = {"dispatch-16": 1.03, "dispatch-64": 1.03, "compute-4": 1.01}


class _Batches:
    """A new batch for every step, made outside the timed region and let go of when the next one
    comes, as a data loader's: batches held in a list would all be freed at once after a round,
    which a step then sees in its log and misses its script (a long run frees one a step)."""

    def __init__(self, batch: int, width: int, rank: int) -> None:
        self._shape = (batch, width, rank)
        self._made = 0

    def take(self, n: int) -> Iterator[torch.Tensor]:
        batch, width, rank = self._shape
        for _ in range(n):
            self._made += 1
            yield make_batch(self._made, batch, width, rank)


def _steps(model: Any, opt: Any, xs: Iterator[torch.Tensor], tracker: FSDPMemoryTracker | None,
           ) -> tuple[list[float], list[float]]:
    """Training-thread CPU seconds and wall seconds (barrier to barrier) of one step per batch."""
    cpu, wall = [], []
    for x in xs:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        if tracker is not None:
            tracker.track_inputs(x)
        train_step(model, opt, x)
        if tracker is not None:
            tracker.step()
        c1 = time.thread_time()
        dist.barrier()
        cpu.append(c1 - c0)
        wall.append(time.perf_counter() - t0)
    return cpu, wall


def measure(name: str, rounds: int, steps: int, warmup: int, rank: int, aa: bool = False) -> dict[str, Any]:
    """One model's rounds: per-round ratios and what the tracker did in the timed steps.
    ``aa``: the tracker is attached but neither copy's steps call it (an A/A check of the method)."""
    blocks, width, batch = MODELS[name]
    plain, plain_opt = build(blocks, width, WrapOptions(fsdp=2))
    tracked, tracked_opt = build(blocks, width, WrapOptions(fsdp=2))
    batches = _Batches(batch, width, rank)
    tracker = FSDPMemoryTracker(tracked, tracked_opt, mode="light")
    cpu_ratios, wall_ratios = [], []
    with tracker:
        _steps(plain, plain_opt, batches.take(warmup), None)
        _steps(tracked, tracked_opt, batches.take(warmup), tracker)
        script = tracker._sink.script
        replayed0, misses0, steps0 = script.replayed, script.misses, tracker.steps_completed
        if aa:  # the "tracked" copy trains as the other does: FSDP's hooks and ours are not called
            tracker.detach()
        for r in range(rounds):
            timed: dict[bool, tuple[list[float], list[float]]] = {}
            for is_tracked in ((False, True) if r % 2 == 0 else (True, False)):
                model, opt = (tracked, tracked_opt) if is_tracked else (plain, plain_opt)
                timed[is_tracked] = _steps(model, opt, batches.take(steps),
                                           tracker if is_tracked and not aa else None)
            cpu_ratios.append(statistics.median(timed[True][0]) / statistics.median(timed[False][0]))
            wall_ratios.append(statistics.median(timed[True][1]) / statistics.median(timed[False][1]))
            if rank == 0:
                print(f"  {name} round {r + 1}/{rounds}: untracked {statistics.median(timed[False][0]) * 1e3:.2f} ms "
                      f"CPU, tracked {cpu_ratios[-1]:.3f}x (wall {wall_ratios[-1]:.3f}x)", flush=True)
        timed_steps = tracker.steps_completed - steps0
        replayed = script.replayed - replayed0
        done = {"replayed": replayed, "learnt": timed_steps - replayed, "misses": script.misses - misses0,
                "errors": tracker.errors_total}
    return {"cpu_ratio": statistics.median(cpu_ratios), "wall_ratio": statistics.median(wall_ratios),
            "cpu_ratios": cpu_ratios, "wall_ratios": wall_ratios, "tracker": done}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--rounds", type=int, default=61, help="rounds per model, alternating the copies (default 61)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per copy per round (default 2)")
    p.add_argument("--warmup", type=int, default=40, help="untimed steps per copy before the rounds (default 40)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    p.add_argument("--aa", action="store_true",
                   help="A/A check: detach the tracker after the warm-up, so that both copies train untracked "
                        "and the ratios show what the method alone reads (about 1.000x if unbiased)")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    for flag in ("rounds", "steps", "warmup"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}: must be at least 1, got {getattr(args, flag)}")
    rank, world = init_distributed()
    results = {name: measure(name, args.rounds, args.steps, args.warmup, rank, args.aa) for name in names}
    if rank == 0:
        print(f"world_size={world} torch={torch.__version__} rounds={args.rounds} steps={args.steps} "
              f"warmup={args.warmup}" + (" A/A: both copies untracked" if args.aa else ""))
        print(f"{'model':<14} {'CPU ratio':>10} {'range':>15} {'wall ratio':>11} {'target':>7}  "
              "tracker in the timed steps")
        for name, r in results.items():
            t = r["tracker"]
            print(f"{name:<14} {r['cpu_ratio']:9.3f}x {min(r['cpu_ratios']):6.3f}-{max(r['cpu_ratios']):.3f}x "
                  f"{r['wall_ratio']:10.3f}x {TARGETS[name]:6.2f}x  {t['replayed']} replayed, {t['learnt']} learnt, "
                  f"{t['misses']} missed, {t['errors']} errors")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world, "torch": torch.__version__, "rounds": args.rounds, "steps": args.steps,
                       "warmup": args.warmup, "aa": args.aa, "models": results}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
