"""The tracker's cost on a GPU-bound step, and what its allocator reads cost (needs a CUDA device).

Run (one GPU, FSDP2 over a 1-rank NCCL group):

    python benchmarks/gpu_cost.py [--rounds 5] [--steps 10] [--batch 4] [--compile] [--json PATH]

Model: the HF Llama of tests/cuda_llama.py (337M parameters, bf16, batch 4 x 2048 tokens, AdamW).
Variants, interleaved round by round (the order rotates each round): untracked, light,
light_allocator (light with ``reset_peaks=True``: op temporaries from the allocator's peak
counters at every module window's edges) and deep (eager only: a compiled model's deep steps stay
light). Each round attaches the variant's tracker, runs two steps untimed, then ``--steps`` timed
ones, then detaches. Per step: wall time (to ``torch.cuda.synchronize()`` after
``tracker.step()``), host time (the training thread's wall time until the step, ``tracker.step()``
included, is enqueued, before the synchronize) and the thread's CPU time over the same stretch.
Ratios are each variant's median over rounds of its mean step, over untracked's. ``--compile``
compiles each decoder layer in place before sharding (torchtitan's way, inductor).

Allocator reads: the calls the tracker makes per step (``AllocatorProbe.sample``, counted in a light
step) and the per-call time of each way to read the allocator, in a loop.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_mem_otel.config import TrackerConfig  # noqa: E402
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker  # noqa: E402
from tests import cuda_llama  # noqa: E402

#: variant -> (mode, reset_peaks); light_allocator: op temporaries from the allocator's peak counters
VARIANTS = {"untracked": None, "light": ("light", False), "light_allocator": ("light", True), "deep": ("deep", False)}


def _tracker(model: Any, opt: Any, name: str) -> FSDPMemoryTracker | None:
    if VARIANTS[name] is None:
        return None
    mode, reset_peaks = VARIANTS[name]  # type: ignore[misc]
    return FSDPMemoryTracker(model, opt, config=TrackerConfig(mode=mode, reset_peaks=reset_peaks)).attach()


def _steps(model: Any, opt: Any, ids: torch.Tensor, tracker: FSDPMemoryTracker | None, n: int,
           ) -> list[tuple[float, float, float]]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.thread_time()
        cuda_llama.train_step(model, opt, ids)
        if tracker is not None:
            tracker.step()
        host, cpu = time.perf_counter() - t0, time.thread_time() - c0
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0, host, cpu))
    return out


def measure(rounds: int, steps: int, compiled: bool, batch: int = cuda_llama.BATCH) -> dict[str, Any]:
    model, opt, ids = cuda_llama.build(compile_layers=compiled, batch=batch)
    for _ in range(3):
        cuda_llama.train_step(model, opt, ids)
    variants = [v for v in VARIANTS if not (compiled and v == "deep")]
    per: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    skipped: set[str] = set()
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for name in order:
            tracker = _tracker(model, opt, name)
            _steps(model, opt, ids, tracker, 2)
            got = _steps(model, opt, ids, tracker, steps)
            if tracker is not None:
                report = tracker.step()
                if report.deep_skipped:
                    skipped.add(f"{name}: {report.deep_skipped}")
                assert tracker.errors_total == 0, f"{name}: {tracker.errors_total} tracker errors"
                tracker.detach()
            per[name].append(tuple(statistics.fmean(x[i] for x in got) for i in range(3)))  # type: ignore[arg-type]
    result: dict[str, Any] = {"compiled": compiled, "batch": batch, "rounds": rounds, "steps": steps,
                              "deep_skipped": sorted(skipped)}
    for name, means in per.items():
        wall, host, cpu = (statistics.median(m[i] for m in means) for i in range(3))
        result[name] = {"wall_ms": wall * 1e3, "host_ms": host * 1e3, "cpu_ms": cpu * 1e3,
                        "wall_per_round_ms": [round(m[0] * 1e3, 3) for m in means]}
    base = result["untracked"]
    for name in variants[1:]:
        for k in ("wall", "host", "cpu"):
            result[name][f"{k}_ratio"] = result[name][f"{k}_ms"] / base[f"{k}_ms"]
    del model, opt, ids
    gc.collect()  # FSDP holds reference cycles
    torch.cuda.empty_cache()
    return result


def allocator_reads(calls: int = 2000) -> dict[str, Any]:
    """Per-call time of each allocator read, and how many the light tracker makes per step."""
    from fsdp_mem_otel.training import allocator

    model, opt, ids = cuda_llama.build()
    tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig(mode="light", reset_peaks=False)).attach()
    probe = tracker._probe  # sampling: reset_peaks (the default on CUDA) has no sampler
    counted = {"sample": 0}
    sample = probe.sample

    def counting() -> None:
        counted["sample"] += 1
        sample()

    probe.sample = counting  # type: ignore[method-assign]
    tracker._sink._sample = counting
    for _ in range(2):
        cuda_llama.train_step(model, opt, ids)
        tracker.step()
    counted["sample"] = 0
    cuda_llama.train_step(model, opt, ids)
    tracker.step()
    per_step = counted["sample"]
    edges = allocator.AllocatorProbe([0], reset_peaks=True)
    edges.start()  # takes the peak counters (the script's view shadowed) until stop()
    reads = {
        "AllocatorProbe.sample": sample,
        "memory_stats_as_nested_dict": lambda: torch.cuda.memory_stats_as_nested_dict(0),
        "memory_stats": lambda: torch.cuda.memory_stats(0),
        "memory_allocated": lambda: torch.cuda.memory_allocated(0),
        "mem_get_info": lambda: torch.cuda.mem_get_info(0),
        "AllocatorProbe.step_stats": lambda: probe.step_stats({"cuda:0": 0}),
        "AllocatorProbe.window_edge (light_allocator)": edges.window_edge,  # read, fold the shadow, reset
    }
    out: dict[str, Any] = {"sample_calls_per_step": per_step, "allocator_module": allocator.__name__}
    for name, fn in reads.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[f"{name}_us"] = (time.perf_counter() - t0) / calls * 1e6
    edges.stop()
    tracker.detach()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round (default 10)")
    p.add_argument("--compile", action="store_true", help="compile each decoder layer (inductor) before sharding")
    p.add_argument("--batch", type=int, default=cuda_llama.BATCH,
                   help=f"sequences of {cuda_llama.SEQ} tokens per step (default {cuda_llama.BATCH}); "
                        "larger is more GPU-bound")
    p.add_argument("--reads", action="store_true", help="also time the allocator reads")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_cost.py needs a CUDA device", file=sys.stderr)
        return 2
    cuda_llama.init_one_rank_nccl()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    result["cost"] = measure(args.rounds, args.steps, args.compile, args.batch)
    if args.reads:
        result["reads"] = allocator_reads()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
