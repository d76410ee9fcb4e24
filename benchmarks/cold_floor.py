"""What one entry into the tracker costs when training's own work ran just before it.

Run (one process, CPU, a few seconds):

    OMP_NUM_THREADS=1 python benchmarks/cold_floor.py [--calls 400] [--rounds 5]

``hook_timing.py`` times the tracker's entry points in place, between torch's ops, and finds them
several times slower per call than the same calls in a loop. This script shows why, without FSDP:
each operation is timed call by call, once back to back (warm: the code and data it touches stay
in the CPU caches) and once with a torch op between calls that, like a training step's kernels,
pushes them out of the caches (cold: a 256x256 matmul and a pass over an 8 MiB tensor). Timed:

- an empty Python function (the least a hook can cost), and one against five nested method calls
  (what each further frame on a hot path adds),
- the parts of a saved activation's entry: its storage, device, size, weak reference, ledger entry;
  and a snapshot as one counter list against ``Ledger.raw()`` (the ``{device: counters}`` copy),
- ``t.detach()`` (what the saved-tensor pack hook must return),
- the pack hook on a storage the ledger knows and on a new one (its entry and weak reference),
- ``Sink.on_state`` through a module's four forward states (snapshots, window open and close),
- a whole dispatch-16 step's recorder and ledger work in one pass (its 136 states and ~400 counter
  changes, the module reports): what accounting replayed from a log would cost at a window's or the
  step's end, where only its first touches are cold (in place, spread over the step, the recorder's
  part alone takes about 0.9 ms: ``hook_timing.py --nested``).

The cold column is the floor a hook pays in place: fewer entries per step, and less code and data
touched per entry, are what lower light mode's in-place cost, more than fewer bytecodes per call.
Prints microseconds per call, the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from collections.abc import Callable

import torch

from fsdp_mem_otel.schema import (
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    AFTER_PRE_BACKWARD,
    AFTER_PRE_FORWARD,
    BEFORE_POST_BACKWARD,
    BEFORE_POST_FORWARD,
    BEFORE_PRE_BACKWARD,
    BEFORE_PRE_FORWARD,
)
from fsdp_mem_otel.training.light.ledger import Ledger
from fsdp_mem_otel.training.light.recorder import StepRecorder
from fsdp_mem_otel.training.light.sink import Sink

_STATES = (BEFORE_PRE_FORWARD, AFTER_PRE_FORWARD, BEFORE_POST_FORWARD, AFTER_POST_FORWARD)


def _empty(_t: torch.Tensor) -> None:
    return None


def per_call(op: Callable[[int], object], calls: int, between: Callable[[], object] | None) -> float:
    """Microseconds per ``op(i)``, timed call by call (the timer's own cost subtracted)."""
    t0 = time.perf_counter()
    time.perf_counter()
    timer = time.perf_counter() - t0
    total = 0.0
    keep = []
    for i in range(calls):
        if between is not None:
            between()
        t0 = time.perf_counter()
        keep.append(op(i))
        total += time.perf_counter() - t0 - timer
    return max(total, 0.0) / calls * 1e6


def _fresh_sink() -> Sink:
    ledger = Ledger()
    sink = Sink(ledger, StepRecorder(ledger), lambda exc: None)
    sink.active = True
    return sink


class _Chain:
    """Methods calling each other: what one more Python frame on a hot path costs, cold."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def five(self) -> None:
        self.four()

    def four(self) -> None:
        self.three()

    def three(self) -> None:
        self.two()

    def two(self) -> None:
        self.one()

    def one(self) -> None:
        self.n += 1


def _on_free(_ref: object) -> None:
    return None


_BLOCKS = [f"layers.{i}" for i in range(16)]
# category indexes (ledger.INDEX order does not matter here: the work is the same for any)
_UP, _UG, _SG, _AG, _ACT, _RS = 1, 2, 3, 4, 5, 6


def one_step(rec: StepRecorder, led: Ledger) -> None:
    """A dispatch-16 step's states and counter changes, as FSDP2's group events and the saved
    activations make them, through the recorder and the ledger, and the module reports built (and
    dropped: kept over hundreds of calls, they would time the garbage collector)."""
    rec.reset()
    on, add = rec.on_state, led.add_at
    on("<root>", BEFORE_PRE_FORWARD)
    on("<root>", AFTER_PRE_FORWARD)
    for key in _BLOCKS:
        on(key, BEFORE_PRE_FORWARD)
        add("cpu", _AG, 1000), add("cpu", _UP, 2000), add("cpu", _AG, -1000)
        on(key, AFTER_PRE_FORWARD)
        for _ in range(6):
            add("cpu", _ACT, 100)
        on(key, BEFORE_POST_FORWARD)
        add("cpu", _UP, -2000)
        on(key, AFTER_POST_FORWARD)
    on("<root>", BEFORE_POST_FORWARD)
    on("<root>", AFTER_POST_FORWARD)
    on("<root>", BEFORE_PRE_BACKWARD, True)
    on("<root>", AFTER_PRE_BACKWARD, True)
    for key in reversed(_BLOCKS):
        on(key, BEFORE_PRE_BACKWARD, True)
        add("cpu", _AG, 1000), add("cpu", _UP, 2000), add("cpu", _AG, -1000)
        on(key, AFTER_PRE_BACKWARD, True)
        for _ in range(6):
            add("cpu", _ACT, -100)
        add("cpu", _UG, 2000)
        on(key, BEFORE_POST_BACKWARD, True)
        for cat, delta in ((_UG, -2000), (_RS, 2000), (_SG, 1000), (_UP, -2000), (_RS, -2000), (_SG, -1000)):
            add("cpu", cat, delta)
        on(key, AFTER_POST_BACKWARD, True)
    on("<root>", BEFORE_POST_BACKWARD, True)
    on("<root>", AFTER_POST_BACKWARD, True)
    rec.close_open_windows()
    led.step_peak()
    rec.modules  # noqa: B018 - built for its cost
    led.reset_step()


def operations(calls: int) -> dict[str, Callable[[int], object]]:
    """The timed operations, each ``op(i)`` on the i-th of ``calls`` fresh tensors."""
    tensors = [torch.randn(32, 32) for _ in range(calls)]
    storages = [t.untyped_storage() for t in tensors]
    known, new, states = _fresh_sink(), _fresh_sink(), _fresh_sink()
    for t in tensors:
        known.activations._pack(t)  # their storages are known from now on
    chain = _Chain()
    ledger = Ledger()  # one device's counters, as the ledger keeps them
    for i, category in enumerate(("sharded_param", "activation", "unsharded_grad")):
        ledger.add("cpu", category, 10**9 + 4096 * i)
    counters = ledger.raw()["cpu"]
    entries: dict[int, list[object]] = {}
    step_ledger = Ledger()
    step_recorder = StepRecorder(step_ledger)
    return {
        "empty Python call": lambda i: _empty(tensors[i]),
        "one method call": lambda i: chain.one(),
        "five nested method calls": lambda i: chain.five(),
        "t.detach()": lambda i: tensors[i].detach(),
        "t.untyped_storage()": lambda i: tensors[i].untyped_storage(),
        "storage.device": lambda i: storages[i].device,
        "storage.nbytes()": lambda i: storages[i].nbytes(),
        "weakref.KeyedRef(storage)": lambda i: weakref.KeyedRef(storages[i], _on_free, i),
        "a ledger entry (list, dict insert)": lambda i: entries.__setitem__(i, ["cpu", 3, 4096, None, 1, None]),
        "snapshot: counters list copy": lambda i: counters[:],
        "snapshot: Ledger.raw()": lambda i: ledger.raw(),
        "pack hook, known storage": lambda i: known.activations._pack(tensors[i]),
        "pack hook, new storage": lambda i: new.activations._pack(tensors[i]),
        "Sink.on_state (forward states)": lambda i: states.on_state(f"m{i // 4 % 16}", _STATES[i % 4]),
        "a dispatch-16 step in one pass": lambda i: one_step(step_recorder, step_ledger),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=400, help="calls per operation and round (default 400)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; the median is printed (default 5)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    big = torch.ones(2 * 1024 * 1024)  # 8 MiB

    def training_op() -> None:
        torch.mm(a, a)
        big.sum()

    results: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        warm_ops, cold_ops = operations(args.calls), operations(args.calls)
        for name in warm_ops:
            warm = per_call(warm_ops[name], args.calls, None)
            cold = per_call(cold_ops[name], args.calls, training_op)
            results.setdefault(name, []).append((warm, cold))
    print(f"{'operation':<34} {'warm us/call':>13} {'cold us/call':>13} {'cold/warm':>10}")
    for name, rows in results.items():
        warm = statistics.median(r[0] for r in rows)
        cold = statistics.median(r[1] for r in rows)
        ratio = f"{cold / warm:9.1f}x" if warm >= 0.05 else f"{'-':>10}"  # below the timer's resolution
        print(f"{name:<34} {warm:13.2f} {cold:13.2f} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
