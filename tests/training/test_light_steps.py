"""Light steps on 2 real ranks: they keep nothing the training made past their step (weak
references against the same training untracked), and each module state gets the time it was
reached (ordered by time, a report's events are the order FSDP's hooks ran in)."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks


def what_steps_keep(tracked: bool) -> list[int]:
    """Rank body: weak references to the storage of every block's output and every saved tensor
    of each step (saved-tensor hooks of the test's own, below the tracker's); how many outlive
    the step after theirs."""
    import gc
    import weakref

    rank = torch.distributed.get_rank()
    model, opt = build(3, 32, WrapOptions(fsdp=2))
    seen: list[weakref.ref[torch.UntypedStorage]] = []
    for name, mod in model.named_modules():
        if name.startswith("layers.") and name.count(".") == 1:
            mod.register_forward_hook(lambda _m, _a, out: seen.append(weakref.ref(out.untyped_storage())))
    tracker = FSDPMemoryTracker(model, opt).attach() if tracked else None
    per_step: list[list[weakref.ref[torch.UntypedStorage]]] = []
    alive_after = []

    def spy(t: torch.Tensor) -> torch.Tensor:
        seen.append(weakref.ref(t.untyped_storage()))
        return t

    for step in range(12):
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(spy, lambda t: t):
            train_step(model, opt, make_batch(step, 8, 32, rank))
        if tracker is not None:
            tracker.step()
        per_step.append(seen)
        if step >= 1:
            gc.collect()
            alive_after.append(sum(ref() is not None for ref in per_step[step - 1]))
    if tracker is not None:
        tracker.detach()
    return alive_after


def test_light_steps_keep_nothing_the_training_made() -> None:
    # oracle: the same training untracked (FSDP keeps its unsharded parameters' storages itself)
    untracked = run_ranks(what_steps_keep, False)
    for alive_after, alone in zip(run_ranks(what_steps_keep, True), untracked, strict=True):
        assert alive_after == alone  # a step's outputs and saved tensors: as untracked, a step later
        assert all(n < 20 for n in alone)  # (those FSDP keeps, not everything)


def state_times_in_order(steps: int) -> tuple[list[list[tuple[str, str]]], list[list[tuple[str, str]]]]:
    """Per step: the (module, state) events in the order FSDP2's hooks reported them, and the same
    events ordered by the times the step's report gives them. The sink's clock is a counter, so
    each event's time is its place in the step."""
    import itertools

    from fsdp_mem_otel.schema import BACKWARD_STATES, FORWARD_STATES
    from fsdp_mem_otel.training.light import sink as sink_module

    rank = torch.distributed.get_rank()
    model, opt = build(3, 32, WrapOptions(fsdp=2))
    tracker = FSDPMemoryTracker(model, opt).attach()
    sink = tracker._sink
    clock = itertools.count(1)
    sink_module._time_ns, real_clock = clock.__next__, sink_module._time_ns
    called: list[tuple[str, str]] = []
    on_state, backward_state = sink.on_state, sink.backward_state

    def forward_event(key: str, state: str, *args: Any) -> None:
        called.append((key, state))
        on_state(key, state, *args)

    def backward_event(key: str, state: str, *args: Any) -> None:
        called.append((key, state))
        backward_state(key, state, *args)

    sink.on_state, sink.backward_state = forward_event, backward_event  # type: ignore[method-assign]
    hooked_order, reported_order = [], []
    fsdp_states = FORWARD_STATES | BACKWARD_STATES  # not the peaks: they take their closing state's time
    try:
        for step in range(steps):
            called.clear()
            train_step(model, opt, make_batch(step, 8, 32, rank))
            report = tracker.step()
            timed = sorted((t, key, state) for key, mod in report.modules.items()
                           for state, times in mod.times.items() if state in fsdp_states for t in times)
            hooked_order.append(list(called))
            reported_order.append([(key, state) for _, key, state in timed])
    finally:
        sink_module._time_ns = real_clock
        tracker.detach()
    return hooked_order, reported_order


def test_light_steps_give_each_state_the_time_it_was_reached() -> None:
    """The deferred log keeps each event's time: ordered by time, a report's events are the order
    the hooks ran in, on every step."""
    steps = 8
    for hooked, reported in run_ranks(state_times_in_order, steps):
        for step, (ran, timed) in enumerate(zip(hooked, reported, strict=True), 1):
            assert len(ran) > 20, f"step {step}: too few state events"
            assert timed == ran, f"step {step}: times out of order"
