"""Light steps replayed on the steps that repeat the learnt ones (step_script.py): on 2 real
ranks, a run that replays reports what a run that learns every step reports, step by step;
replayed steps push no saved-tensor hooks and tell FSDP2's light groups of no event; what does not
repeat learns again or is counted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.training import step_script
from fsdp_mem_otel.training.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks

_NOT_COMPARED = {"timestamp", "duration_seconds", "start_time_ns", "end_time_ns", "tracker_overhead_seconds",
                 "times", "allocator", "errors_total", "replay_misses"}


def _figures(report: dict[str, Any]) -> Any:
    """A report's figures, timings left out (they differ between any two runs)."""
    def strip(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in _NOT_COMPARED}
        if isinstance(d, list):
            return [strip(x) for x in d]
        return d
    return strip(report)


@dataclass
class Run:
    figures: list[Any]  # per step
    hooked: list[bool]  # per step: saved-tensor hooks were set during the first block's forward
    group_events: list[int]  # per step: FSDP2 light groups told of an unshard
    misses: list[int]  # per step: StepReport.replay_misses
    replayed: int
    errors: int


def _run(replay: bool, steps: int, opts: WrapOptions, batch_of: Any = None, between: Any = None,
         verify_every: int | None = None, before: Any = None) -> Run:
    if verify_every is not None:
        step_script.VERIFY_EVERY = verify_every
    from fsdp_mem_otel.training.adapters.fsdp2_groups import LightGroup

    unshards = [0]
    after_unshard = LightGroup.after_unshard

    def counted(self: LightGroup) -> None:
        unshards[0] += 1
        after_unshard(self)

    LightGroup.after_unshard = counted  # type: ignore[method-assign]
    rank = torch.distributed.get_rank()
    model, opt = build(3, 32, opts)
    seen: list[bool] = []  # per forward of the first block outside backward: hooks were set
    hooked: list[bool] = []
    first_block = next(m for name, m in model.named_modules() if name.endswith("layers.0"))
    first_block.register_forward_hook(lambda *_: seen.append(
        torch._C._autograd._top_saved_tensors_default_hooks(True) is not None)
        if torch._C._current_graph_task_id() == -1 else None)
    tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig(replay_steps=replay)).attach()
    figures, misses, group_events = [], [], []
    for step in range(steps):
        rows = 8 if batch_of is None else batch_of(step)
        mark, unshards[0] = len(seen), 0
        on_inputs = None if before is None else (lambda _, step=step: before(step, tracker))
        train_step(model, opt, make_batch(step, rows, 32, rank), on_inputs=on_inputs)
        hooked.append(any(seen[mark:]))
        group_events.append(unshards[0])
        if between is not None:
            between(step, tracker)
        report = tracker.step()
        figures.append(_figures(report.to_dict()))
        misses.append(report.replay_misses)
    tracker.detach()
    LightGroup.after_unshard = after_unshard  # type: ignore[method-assign]
    return Run(figures, hooked, group_events, misses, tracker._sink.script.replayed, tracker.errors_total)


def replayed_against_hooked(opts: WrapOptions, steps: int, batch_of: Any = None) -> tuple[Run, Run]:
    return _run(False, steps, opts, batch_of), _run(True, steps, opts, batch_of)


@pytest.mark.parametrize("opts", [
    WrapOptions(fsdp=2), WrapOptions(fsdp=1), WrapOptions(fsdp=2, checkpoint=True),
    WrapOptions(fsdp=1, checkpoint=True), WrapOptions(fsdp=2, inner_checkpoint=True),
    WrapOptions(fsdp=2, nested=True, reshard_after_forward=False),
], ids=["fsdp2", "fsdp1", "fsdp2_ac", "fsdp1_ac", "fsdp2_inner_ac", "fsdp2_nested_no_reshard"])
def test_replayed_steps_report_what_hooked_steps_report(opts: WrapOptions) -> None:
    steps = 22  # learn 1-3, replay from 4, check at 20
    for hooked, replayed in run_ranks(replayed_against_hooked, opts, steps, timeout=600):
        assert hooked.errors == replayed.errors == 0
        assert all(hooked.hooked) and hooked.replayed == 0
        assert replayed.replayed >= steps - 5
        assert replayed.hooked.count(False) == replayed.replayed  # replayed steps set no hooks
        if opts.fsdp == 2:  # and their light groups hear of no event after the root's own unshard
            assert all(n > 1 for n in hooked.group_events)
            assert [n <= 1 for n in replayed.group_events] == [not h for h in replayed.hooked]
        assert replayed.misses[-1] == 0
        for step, (ours, theirs) in enumerate(zip(replayed.figures, hooked.figures, strict=True), 1):
            assert ours == theirs, f"step {step} differs"
        assert any(m["snapshots"]["after_post_forward"][0]["cpu"]["activation"] > 0
                   for m in replayed.figures[-1]["modules"].values())


def _rows(step: int) -> int:
    return 8 if step < 8 else 12


def test_other_input_shapes_learn_again_and_stay_exact() -> None:
    for hooked, replayed in run_ranks(replayed_against_hooked, WrapOptions(fsdp=2), 16, _rows):
        assert replayed.errors == 0 and replayed.misses[-1] == 0
        assert replayed.hooked[8:10] == [True, True]  # the new shape learns (twice alike), then replays
        assert not any(replayed.hooked[10:])
        assert replayed.figures == hooked.figures


def one_step_apart(verify_every: int) -> tuple[Run, Run]:
    def before(step: int, tracker: FSDPMemoryTracker) -> None:
        if step == 9:  # something no learnt step logged, before the forward: step 10 parts from its script
            tracker.track_inputs(torch.ones(100))
    runs = [_run(replay, 14, WrapOptions(fsdp=2), verify_every=verify_every, before=before)
            for replay in (False, True)]
    return runs[0], runs[1]


def test_a_step_that_does_not_fit_its_script_is_counted_and_the_next_ones_are_exact_again() -> None:
    for hooked, replayed in run_ranks(one_step_apart, 100):
        assert replayed.errors == 0
        assert replayed.misses[8] == 0 and replayed.misses[9] == 1  # step 10 did not fit
        assert replayed.misses[-1] == 1
        # step 11 learns what the script says: replayed again from step 12
        assert not any(replayed.hooked[3:10]) and replayed.hooked[10] and not any(replayed.hooked[11:])
        for step in (*range(9), 10, 11, 12, 13):  # the missed step's own figures may be off: counted
            assert replayed.figures[step] == hooked.figures[step], step
        # what it got wrong does not stay: the step ends where the hooked one does
        assert replayed.figures[9]["current"] == hooked.figures[9]["current"]


def changing_activations(verify_every: int) -> tuple[Run, Run]:
    """Activations that change while the inputs' shapes and FSDP's events do not: each block's
    forward saves a tensor whose size depends on the step (as token routing would)."""
    import fsdp_mem_otel.training.demo as demo

    state = {"step": 0}
    original = demo.Block.forward

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        extra = torch.ones(1 + 64 * (state["step"] // 8), requires_grad=True)
        return original(self, x) + (extra * extra).sum() * 0

    demo.Block.forward = forward  # type: ignore[method-assign]

    def between(step: int, tracker: FSDPMemoryTracker) -> None:
        state["step"] = step + 1
    runs = []
    for replay in (False, True):
        state["step"] = 0
        runs.append(_run(replay, 14, WrapOptions(fsdp=2), between=between, verify_every=verify_every))
    return runs[0], runs[1]


def test_activations_that_change_under_the_same_events_are_found_by_the_check() -> None:
    # learn 1-3, replay 4-7; steps 9-12 save more than the script says: the check at step 12 finds it
    for hooked, replayed in run_ranks(changing_activations, 4):
        assert replayed.errors == 0
        assert replayed.hooked[:3] == [True] * 3 and not any(replayed.hooked[3:7])
        assert replayed.hooked[7] and not any(replayed.hooked[8:12])  # step 8 checks: unchanged yet
        assert replayed.misses[11] == 0 and replayed.misses[12] == 1  # step 13 checks: changed
        assert replayed.hooked[12:] == [True, True]
        assert replayed.figures[:8] == hooked.figures[:8]
        assert replayed.figures[8] != hooked.figures[8]  # replayed with what it no longer saves
        assert replayed.figures[12:] == hooked.figures[12:]


def kept_graphs() -> tuple[Run, Run]:
    kept: list[torch.Tensor] = []

    def between(step: int, tracker: FSDPMemoryTracker) -> None:
        if step == 1:  # a graph kept past its step: its saved tensors stay alive until dropped
            kept.append(tracker.model(make_batch(99, 8, 32, torch.distributed.get_rank())).sum())
        if step == 5:
            kept.clear()
    runs = [_run(replay, 14, WrapOptions(fsdp=2), between=between) for replay in (False, True)]
    return runs[0], runs[1]


def test_saved_tensors_that_outlive_their_step_stop_the_replay_while_they_live() -> None:
    for hooked, replayed in run_ranks(kept_graphs):
        assert replayed.errors == 0 and replayed.misses[-1] == 0
        # steps 3-6 learn while it lives, steps 6-8 learn until two agree, then the replay goes on
        assert all(replayed.hooked[:8]) and not any(replayed.hooked[8:])
        assert replayed.figures == hooked.figures


def late_input() -> tuple[Run, Run]:
    kept: list[torch.Tensor] = []

    def between(step: int, tracker: FSDPMemoryTracker) -> None:
        if step == 9:  # after the optimizer step: past all the script, the step's own change
            kept.append(torch.ones(100))
            tracker.track_inputs(kept[-1])
    runs = [_run(replay, 14, WrapOptions(fsdp=2), between=between) for replay in (False, True)]
    return runs[0], runs[1]


def test_a_change_after_all_of_the_script_is_the_steps_own_and_exact() -> None:
    for hooked, replayed in run_ranks(late_input):
        assert replayed.errors == 0 and replayed.misses[-1] == 0
        assert not any(replayed.hooked[3:10])  # step 10 replayed, the input on top
        assert replayed.figures == hooked.figures
        assert replayed.figures[9]["current"]["cpu"]["inputs"] == hooked.figures[8]["current"]["cpu"]["inputs"] + 400


def learnt_and_replayed_over_configs(names: list[str]) -> list[tuple[list[Any], list[Any], int, int]]:
    """Rank body: each of test_light_groups' FSDP2 configurations trained twice from the same
    seed, learning every step and replaying; the reports of every step, replayed steps, errors."""
    from tests.oracles import BATCH, WIDTH
    from tests.training.test_light_groups import CONFIGS, _build

    rank = torch.distributed.get_rank()
    out = []
    for name in names:
        cfg = CONFIGS[name]
        runs = []
        for replay in (False, True):
            model, opt = _build(cfg)
            tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig(replay_steps=replay)).attach()
            micro = cfg.get("micro_batches", 1)
            reports = []
            for step in range(22):
                opt.zero_grad(set_to_none=True)
                for i, chunk in enumerate(make_batch(step, BATCH, WIDTH, rank).chunk(micro)):
                    if cfg.get("no_sync_first"):
                        model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
                    tracker.track_inputs(chunk)
                    model(chunk).float().pow(2).mean().backward()
                opt.step()
                reports.append(_figures(tracker.step().to_dict()))
            tracker.detach()
            runs.append((reports, tracker._sink.script.replayed, tracker.errors_total + tracker._sink.script.misses))
        out.append((runs[0][0], runs[1][0], runs[1][1], runs[0][2] + runs[1][2]))
    return out


def test_replayed_steps_equal_learnt_ones_over_the_light_group_configurations() -> None:
    # light mode's learnt steps equal deep mode's over these (test_light_groups.py): so do replayed ones
    from tests.training.test_light_groups import CONFIGS

    names = list(CONFIGS)
    for per_rank in run_ranks(learnt_and_replayed_over_configs, names, timeout=900):
        for name, (learnt, replayed, n_replayed, bad) in zip(names, per_rank, strict=True):
            assert bad == 0, name
            # a group accounted per tensor (the fallback) keeps every step learning
            assert n_replayed == 0 if name == "sometimes_unused" else n_replayed >= 15, (name, n_replayed)
            for step, (ours, theirs) in enumerate(zip(replayed, learnt, strict=True), 1):
                assert ours == theirs, (name, step)


def what_steps_keep(tracked: bool) -> tuple[int, list[int]]:
    """Rank body: weak references to the storage of every block's output and every saved tensor
    of each step (saved-tensor hooks of the test's own, below the tracker's); how many outlive
    the step after theirs; steps replayed."""
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
    if tracker is None:
        return 0, alive_after
    tracker.detach()
    return tracker._sink.script.replayed, alive_after


def test_replayed_steps_keep_nothing_the_training_made() -> None:
    # oracle: the same training untracked (FSDP keeps its unsharded parameters' storages itself)
    untracked = run_ranks(what_steps_keep, False)
    for (replayed, alive_after), (_, alone) in zip(run_ranks(what_steps_keep, True), untracked, strict=True):
        assert replayed >= 8
        assert alive_after == alone  # a step's outputs and saved tensors: as untracked, a step later
        assert all(n < 20 for n in alone)  # (those FSDP keeps, not everything)


def state_times_in_order(steps: int) -> tuple[list[list[tuple[str, str]]], list[list[tuple[str, str]]], int]:
    """Per step: the (module, state) events in the order FSDP2's hooks reported them, and the same
    events ordered by the times the step's report gives them. The sink's clock is a counter, so
    each event's time is its place in the step."""
    import itertools

    from fsdp_mem_otel.schema import BACKWARD_STATES, FORWARD_STATES
    from fsdp_mem_otel.training import sink as sink_module

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
    return hooked_order, reported_order, sink.script.replayed


def test_replayed_steps_give_each_state_the_time_it_was_reached() -> None:
    """A replayed step's log is the script's with this step's times in place; where the replay
    memo puts back what it leaves, the times come from the step's own log in one C call: each
    module state still gets the time it was reached (ordered by time, the report's events are the
    order the hooks ran in), on replayed steps as on learnt ones."""
    steps = 8
    for hooked, reported, replayed in run_ranks(state_times_in_order, steps):
        assert replayed >= steps - 3
        for step, (ran, timed) in enumerate(zip(hooked, reported, strict=True), 1):
            assert len(ran) > 20, f"step {step}: too few state events"
            assert timed == ran, f"step {step}: times out of order"
