"""Where light mode's cost goes: the tracker's own entry points timed in place during training.

Run (2 ranks, gloo, CPU):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/hook_timing.py [--blocks 16] [--steps 20] [--rounds 5]
        [--width 64 --batch 8]   (the compute-bound model: --blocks 4 --width 1024 --batch 256)
        [--model llama]          (an HF Llama of --blocks decoder layers, hidden --width, --batch sequences)

Every function through which training enters the tracker is wrapped with a timer before attach:
the sink's state events (``on_state``: the forward hooks and the group emits), the FSDP2 group
events (named after the accounting method they run), the adapter's catching up at forward
boundaries, the saved-tensor pack and unpack hooks, the ledger's free callbacks, the optimizer
hooks and ``step()``. Only the outermost entry is timed, so nested calls count once. What a timer
adds to the time it records (what a timed no-op records, less the no-op's own call, measured in
each round) times the calls is subtracted: both figures are printed. (Until 2026-11-27 the
timers' whole cost per call was subtracted, their clock calls and bookkeeping outside the
recorded span too: ~0.3 us a call too much, which put the in-place figure ~0.5-0.8 points low at
16 blocks.) The timers read wall time, or with ``--clock cpu`` this thread's CPU time. Rounds
interleave an untracked and a tracked run of the same steps on the same model; per round, the
tracker's time per step is divided by that round's untracked step (training-thread CPU); the
tracked step's CPU, less what the timers add to it, is divided by it too ("tracked step": what
tracking costs the step, the entry points' callers included; slightly high, as the timers that
pass a nested entry through are not taken out, and clearly high with ``--nested``). Printed:
per round and the median over rounds, and the last round's time and calls per entry point;
``--json PATH`` writes them. ``--nested`` also times the methods the entry points call
(``NESTED_POINTS``), to see where an entry's time goes.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

import fsdp_mem_otel.training.adapters.fsdp2 as fsdp2
import fsdp_mem_otel.training.adapters.fsdp2_groups as fsdp2_groups
import fsdp_mem_otel.training.optimizers as optimizers
import fsdp_mem_otel.training.tracker as tracker_module
from fsdp_mem_otel.tools.demo import WrapOptions, build, init_distributed, make_batch, train_step


def _light(name: str) -> Any:
    """A light-mode module, in training/light/ or, in trees before 2026-11-29 (A/B runs), training/."""
    try:
        return importlib.import_module(f"fsdp_mem_otel.training.light.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"fsdp_mem_otel.training.{name}")


activations, ledger, sink = _light("activations"), _light("ledger"), _light("sink")

TIMES: collections.Counter[str] = collections.Counter()
#: the entry timers' clock: wall time (``--clock wall``) or this thread's CPU time (``--clock cpu``)
CLOCK = [time.perf_counter]
CALLS: collections.Counter[str] = collections.Counter()
_depth = [0]


def timed(name: str, fn: Callable[..., Any], times: collections.Counter[str] = TIMES,
          calls: collections.Counter[str] = CALLS, outermost: bool = True) -> Callable[..., Any]:
    """``fn`` adding its time and calls under ``name``; ``outermost``: only when no other timed
    entry point is running (nested entries count once)."""

    depth = 1 if outermost else 0  # what the wrapper adds to the entry-point depth

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if outermost and _depth[0]:
            return fn(*args, **kwargs)
        _depth[0] += depth
        clock = CLOCK[0]
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] += clock() - t0
            calls[name] += 1
            _depth[0] -= depth

    return wrapper


#: ``--nested``: methods timed inside the entry points (every call, nested or not), to split them
NESTED_POINTS: dict[str, tuple[str, ...]] = {
    "fsdp_mem_otel.training.light.recorder.StepRecorder": ("on_state", "close_open_windows", "modules_later"),
    "fsdp_mem_otel.training.light.ledger.Ledger": ("track_new", "snap", "open_window", "close_window_raw",
                                                   "step_end_later", "flush"),
    "fsdp_mem_otel.training.adapters.fsdp2_groups.CommMirror": ("before_wait", "after_wait", "after_post_backward",
                                                                "reconcile"),
    "fsdp_mem_otel.training.adapters.fsdp2_groups.LightGroup": ("after_unshard", "after_wait", "after_reshard",
                                                                "before_post_backward", "after_post_backward",
                                                                "reconcile"),
    "fsdp_mem_otel.training.leaks.LeakWatch": ("observe_later",),
    "fsdp_mem_otel.training.adapters.fsdp2.FSDP2Adapter": ("reconcile",),
    "fsdp_mem_otel.training.light.recorder.StepRecorder ": ("reset",),
    "fsdp_mem_otel.training.light.recorder.StepReplay": ("keep",),
    "fsdp_mem_otel.training.light.sink.Sink": ("end_step",),
    "fsdp_mem_otel.training.adapters.fsdp2._ForwardHooks": ("reconcile",),
    "fsdp_mem_otel.training.light.counters.Counters": ("reset_step",),
}
NESTED: collections.Counter[str] = collections.Counter()
NESTED_CALLS: collections.Counter[str] = collections.Counter()


def nested(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--nested``: ``fn`` timed at every call, inside entry points too."""
    return timed(name, fn, NESTED, NESTED_CALLS, outermost=False)


def instrument_nested() -> None:
    """``--nested``: timers on ``NESTED_POINTS`` (their own cost adds to the entry points that
    call them: read the entry table of such a run as an upper bound)."""
    import importlib

    for path, names in NESTED_POINTS.items():
        module, _, cls_name = path.strip().rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            if hasattr(cls, name):  # older trees have fewer
                setattr(cls, name, nested(f"{cls_name}.{name}", getattr(cls, name)))


def timer_cost(n: int = 20000) -> tuple[float, float]:
    """Seconds a timer adds per call: to the time it records (what a timed no-op records, less the
    no-op's own call, which a real entry point makes too), and to the whole call (both clock reads,
    the wrapper and its bookkeeping: what the timers add to a tracked step)."""

    def noop() -> None:
        return None

    wrapped = timed("calibration", noop)
    clock = CLOCK[0]
    t0 = clock()
    for _ in range(n):
        pass
    loop = clock() - t0  # the loop's own cost, in neither figure
    t0 = clock()
    for _ in range(n):
        noop()
    bare = (clock() - t0 - loop) / n
    t0 = clock()
    for _ in range(n):
        wrapped()
    whole = (clock() - t0 - loop) / n - bare
    recorded = TIMES.pop("calibration", 0.0) / n
    CALLS.pop("calibration", None)
    return max(recorded - bare, 0.0), max(whole, 0.0)


def instrument() -> None:
    """Timers around every entry point (before the tracker is built: wrappers bind at attach)."""
    cls = tracker_module.FSDPMemoryTracker
    cls.step = timed("step()", cls.step)  # type: ignore[method-assign]
    sink.Sink.on_state = timed("on_state (forward hooks, group emits)", sink.Sink.on_state)  # type: ignore[method-assign]
    if hasattr(sink.Sink, "backward_state"):  # older trees had every state go through on_state
        sink.Sink.backward_state = timed("backward_state (FSDP2 backward hooks)",  # type: ignore[method-assign]
                                         sink.Sink.backward_state)
    for name in ("after_unshard", "before_wait", "after_wait", "after_reshard", "before_post_backward",
                 "after_post_backward"):
        if hasattr(fsdp2._Accounts, name):  # older trees forwarded unshard and reshard through it
            setattr(fsdp2._Accounts, name, timed(f"FSDP2 {name}", getattr(fsdp2._Accounts, name)))
    for cls in (fsdp2_groups.LightGroup, fsdp2_groups.TensorGroup):  # what the group wrappers call directly
        for name in ("after_unshard", "after_reshard"):
            setattr(cls, name, timed(f"FSDP2 {name}", getattr(cls, name)))
    for name in ("_forward_begins", "_forward_ends"):
        setattr(fsdp2.FSDP2Adapter, name, timed(f"adapter {name}", getattr(fsdp2.FSDP2Adapter, name)))
    activations.SavedTensorAccounting._pack = timed(  # type: ignore[method-assign]
        "saved-tensor pack", activations.SavedTensorAccounting._pack)
    activations._unpack = timed("saved-tensor unpack", activations._unpack)  # bound at each push
    for name in ("_on_pre", "_on_post"):
        setattr(optimizers.OptimizerWatch, name, timed("optimizer hooks", getattr(optimizers.OptimizerWatch, name)))
    free_callback = ledger._free_callback
    ledger._free_callback = lambda entries, ref: timed("weakref free", free_callback(entries, ref))  # type: ignore


def stub_on_state() -> None:
    """Diagnostic (``--stub-on-state``): ``on_state`` only logs the event (no snapshot, no window,
    no activations): what entering it costs in place, beside what its body costs. Reports of such
    a run are not valid."""

    def on_state(self: sink.Sink, key: str, state: str, tensors: object = None, windowed: bool = True) -> None:
        if self.active:
            self.recorder._append(key, state, (), 0)

    sink.Sink.on_state = on_state  # type: ignore[method-assign]
    sink.Sink.backward_state = on_state  # type: ignore[method-assign]


def stub_all() -> Callable[[], None]:
    """Diagnostic (``--stub-all``): every entry point returns at once, with the same calls per
    step: on_state logs the event and pushes and pops the saved-tensor hooks (so the pack hook
    is still called), the pack hook returns the detached alias, the group and optimizer events do
    nothing; no entry is made, so no free callback runs. What is left is the floor of a design
    with these entry points: being called, in place. Reports of such a run are not valid.
    Returns the function that puts the real entry points back (``step_floor.py`` interleaves)."""
    from fsdp_mem_otel.schema import AFTER_POST_FORWARD, BEFORE_PRE_FORWARD

    def on_state(self: sink.Sink, key: str, state: str, tensors: object = None, windowed: bool = True) -> None:
        if self.active:
            self.recorder._append(key, state, (), 0)
            if sink._in_backward() == -1:  # the sink's own push and pop of the saved-tensor hooks
                if state == BEFORE_PRE_FORWARD:
                    self._forward_begins()
                elif state == AFTER_POST_FORWARD:
                    self._forward_ends()

    def nothing(*_: Any, **__: Any) -> None:
        return None

    stubs: list[tuple[Any, str, Any]] = [(sink.Sink, "on_state", on_state)]
    if hasattr(sink.Sink, "backward_state"):
        stubs.append((sink.Sink, "backward_state", on_state))
    stubs += [(fsdp2._Accounts, name, nothing) for name in ("before_wait", "after_wait", "after_post_backward")]
    stubs += [(cls, name, nothing) for cls in (fsdp2_groups.LightGroup, fsdp2_groups.TensorGroup)
              for name in ("after_unshard", "after_reshard")]
    stubs.append((fsdp2._Accounts, "before_post_backward", lambda self: 0))
    stubs += [(fsdp2.FSDP2Adapter, name, nothing) for name in ("_forward_begins", "_forward_ends")]
    stubs.append((activations.SavedTensorAccounting, "_pack", lambda self, t: t.detach()))
    stubs += [(optimizers.OptimizerWatch, name, nothing) for name in ("_on_pre", "_on_post")]
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in stubs]
    for owner, name, stub in stubs:
        setattr(owner, name, stub)

    def restore() -> None:
        for owner, name, original in originals:
            setattr(owner, name, original)

    return restore


def stub_activation_entries() -> None:
    """Diagnostic (``--stub-activation-entries``): the pack hook adds a new storage's bytes as an
    integer, with no entry and no weak reference (so no free callback, and the bytes never leave):
    what light mode's per-storage bookkeeping of activations costs, beside the rest. Reports of
    such a run are not valid."""
    import torch

    act = ledger.INDEX["activation"]

    def pack(self: activations.SavedTensorAccounting, t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and t.layout is torch.strided:
            st = t.untyped_storage()
            if id(st) not in self._entries:
                self._ledger.add_at("cpu", act, st.nbytes())  # this benchmark runs on CPU
        return t.detach()

    activations.SavedTensorAccounting._pack = pack  # type: ignore[method-assign]


#: ``--model``: the demo's MLP blocks, or the HF Llama of tests/cuda_llama.py (decoder layers)
MODELS = ("mlp", "llama")
LLAMA_SEQ = 64  # tokens per sequence of ``--model llama``


def build_model(kind: str, blocks: int, width: int, batch: int, steps: int, rank: int,
                ) -> tuple[Any, Any, list[Any], Callable[[Any, Any, Any], Any], str]:
    """Model (FSDP2), optimizer, ``steps`` batches, the training step and a label: ``mlp``, the
    demo's ``blocks`` MLP blocks ``width`` wide; ``llama``, an HF ``LlamaForCausalLM`` of ``blocks``
    decoder layers of hidden size ``width`` (float32, FSDP2 per layer and the root, as
    tests/cuda_llama.py shards it), ``batch`` sequences of ``LLAMA_SEQ`` tokens."""
    if kind == "mlp":
        model, opt = build(blocks, width, WrapOptions(fsdp=2))
        xs = [make_batch(i, batch, width, rank) for i in range(steps)]
        label = f"dispatch-{blocks}" if (width, batch) == (64, 8) else f"{blocks} blocks x {width} wide, batch {batch}"
        return model, opt, xs, train_step, label
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import cuda_llama

    torch.manual_seed(0)
    heads = max(1, width // 32)
    config = LlamaConfig(hidden_size=width, intermediate_size=width * 8 // 3, num_hidden_layers=blocks,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=512,
                         max_position_embeddings=LLAMA_SEQ)
    model = cuda_llama.fsdp_wrap(LlamaForCausalLM(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randint(0, 512, (batch, LLAMA_SEQ), generator=gen) for _ in range(steps)]
    return model, opt, xs, cuda_llama.train_step, f"llama-{blocks} (hidden {width}, {batch} x {LLAMA_SEQ} tokens)"


def step_cpu(model: Any, opt: Any, xs: list[Any], tracker: Any = None,
             train: Callable[[Any, Any, Any], Any] = train_step) -> float:
    """Median training-thread CPU seconds of a training step (``train``) over the batches ``xs``
    (each step starts at a barrier), tracked by ``tracker`` (``track_inputs`` and ``step()``
    included) or not."""
    cpu = []
    for x in xs:
        dist.barrier()
        c0 = time.thread_time()
        if tracker is not None:
            tracker.track_inputs(x)
        train(model, opt, x)
        if tracker is not None:
            tracker.step()
        cpu.append(time.thread_time() - c0)
    return statistics.median(cpu)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="mlp",
                   help="the demo's MLP blocks (default), or an HF Llama (--blocks decoder layers of hidden "
                        f"size --width, --batch sequences of {LLAMA_SEQ} tokens; needs transformers)")
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--width", type=int, default=64,
                   help="features per block (default 64: dispatch-bound; overhead.py's compute-4 is --blocks 4 "
                        "--width 1024 --batch 256)")
    p.add_argument("--batch", type=int, default=8, help="rows per micro-batch (default 8)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved untracked/tracked rounds (default 5)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    p.add_argument("--nested", action="store_true",
                   help="also time the methods the entry points call (NESTED_POINTS), printed in a second table")
    p.add_argument("--stub-on-state", action="store_true",
                   help="diagnostic: on_state only logs the event (its entry cost; reports not valid)")
    p.add_argument("--stub-all", action="store_true",
                   help="diagnostic: every entry point returns at once (the floor of being called; reports not valid)")
    p.add_argument("--stub-activation-entries", action="store_true",
                   help="diagnostic: saved activations as integers, no entry or weak reference (reports not valid)")
    p.add_argument("--gc", choices=("on", "off", "freeze"), default="on",
                   help="diagnostic: Python's cyclic garbage collector as usual (on), disabled for the whole run "
                        "(off), or with everything built before the timed rounds frozen out of it (freeze)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="what the entry timers read: wall time (default; time the thread spent descheduled inside "
                        "an entry counts too) or this thread's CPU time, as the untracked step is measured")
    args = p.parse_args(argv)
    if args.clock == "cpu":
        CLOCK[0] = time.thread_time
    if args.stub_activation_entries:
        stub_activation_entries()
    if args.stub_on_state:
        stub_on_state()
    if args.stub_all:
        stub_all()
    rank, _ = init_distributed()
    for name in ("blocks", "width", "batch", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    # the tracker's warm-up and timed runs each get batches of their own, as a data loader gives
    # them: a batch tracked again is no new input
    # (until 2026-11-28 the timed run reused the warm-up's: one miss and two more steps learnt a round)
    model, opt, xs, train, label = build_model(args.model, args.blocks, args.width, args.batch, 2 * args.steps, rank)
    warm_xs, xs = xs[:args.steps], xs[args.steps:]

    def run(tracker: Any, batches: list[Any] = xs) -> float:
        return step_cpu(model, opt, batches, tracker, train)

    instrument()
    if args.nested:
        instrument_nested()
    run(None)  # warm-up: optimizer state, allocator
    if args.gc == "off":
        gc.disable()
    elif args.gc == "freeze":
        gc.collect()
        gc.freeze()
    shares: list[float] = []
    raw_shares: list[float] = []
    step_ratios: list[float] = []
    for _ in range(args.rounds):
        base = run(None)
        tracker = tracker_module.FSDPMemoryTracker(model, opt)
        with tracker:
            run(tracker, warm_xs)  # warm-up: first entries, learnt sizes
            TIMES.clear()
            CALLS.clear()
            NESTED.clear()
            NESTED_CALLS.clear()
            tracked = run(tracker)
        cost, whole_cost = timer_cost()
        calls = sum(CALLS.values()) / args.steps
        raw = sum(TIMES.values()) / args.steps
        per_step = raw - cost * calls
        raw_shares.append(raw / base)
        shares.append(per_step / base)
        # the tracked step beside the untracked one, less what the timers add to it: everything
        # tracking costs the step, the entry points' callers (hook dispatch, wrappers) included
        step_ratios.append((tracked - whole_cost * calls) / base)
        if rank == 0:
            print(f"{label} round {len(shares)}: untracked step {base * 1e3:.2f} ms CPU; "
                  f"tracker in place {per_step * 1e3:.3f} ms/step = {per_step / base:.2%} "
                  f"(timers included {raw / base:.2%}, {cost * 1e6:.2f} us per timed call); "
                  f"tracked step {step_ratios[-1]:.3f}x (timers' {whole_cost * 1e6:.2f} us a call taken out)",
                  flush=True)
    if rank == 0:
        print(f"{label}: median over {args.rounds} rounds {statistics.median(shares):.2%} "
              f"(min {min(shares):.2%}, max {max(shares):.2%}; timers included {statistics.median(raw_shares):.2%}); "
              f"tracked step {statistics.median(step_ratios):.3f}x; last round per entry point (timers included):")
        print(f"{'entry point':<40} {'us/step':>9} {'calls/step':>11} {'share':>7}")
        for name, t in TIMES.most_common():
            print(f"{name:<40} {t / args.steps * 1e6:9.1f} {CALLS[name] / args.steps:11.1f} "
                  f"{t / args.steps / base:7.2%}")
        if NESTED:
            print(f"\n{'inside them (--nested)':<40} {'us/step':>9} {'calls/step':>11} {'share':>7}")
            for name, t in NESTED.most_common():
                print(f"{name:<40} {t / args.steps * 1e6:9.1f} {NESTED_CALLS[name] / args.steps:11.1f} "
                      f"{t / args.steps / base:7.2%}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "blocks": args.blocks, "width": args.width, "batch": args.batch,
                           "clock": args.clock, "timer_cost_us": cost * 1e6,
                           "timer_whole_cost_us": whole_cost * 1e6,
                           "shares": shares, "median": statistics.median(shares), "step_ratios": step_ratios,
                           "shares_with_timers": raw_shares,
                           "entry_points": {n: {"us_per_step": t / args.steps * 1e6,
                                                "calls_per_step": CALLS[n] / args.steps}
                                            for n, t in TIMES.items()}}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
