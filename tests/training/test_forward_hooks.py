"""FSDP2's own forward hooks wrapped in place (one hook call of ours per module and forward), put
back at detach, also with two trackers on one model detached in either order.

Oracles: the modules' hook dicts themselves (what FSDP registered, before any tracker), the
per-module states a forward reports, and bitwise equal training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.schema import AFTER_POST_FORWARD, AFTER_PRE_FORWARD, BEFORE_POST_FORWARD, BEFORE_PRE_FORWARD
from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH, fsdp_fingerprint

_FORWARD = [BEFORE_PRE_FORWARD, AFTER_PRE_FORWARD, BEFORE_POST_FORWARD, AFTER_POST_FORWARD]


def _hooks(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    return {path or "<root>": (len(m._forward_pre_hooks), len(m._forward_hooks))  # the tracker's keys
            for path, m in model.named_modules() if hasattr(m, "_get_fsdp_state")}


@dataclass(frozen=True)
class HooksResult:
    before: dict[str, tuple[int, int]]  # FSDP module -> (pre-hooks, forward hooks), untracked
    during: dict[str, tuple[int, int]]
    fsdp_hooks_in_place: bool  # FSDP's own hook ids still hold a hook while attached
    forward_states: dict[str, list[str]]  # module -> its forward states, in order, one step
    fingerprints: dict[str, Any]  # "before", then after each detach order
    errors: int


def forward_hooks(opts_dict: dict[str, Any]) -> HooksResult:
    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))  # lazy init done
    before, fingerprints = _hooks(model), {"before": fsdp_fingerprint(model, opt)}
    errors = 0
    with FSDPMemoryTracker(model, opt) as tracker:
        during = _hooks(model)
        in_place = True
        for m in model.modules():
            if hasattr(m, "_get_fsdp_state") and m is not model:
                st = m._get_fsdp_state()
                pre = m._forward_pre_hooks.get(st._pre_forward_hook_handle.id)
                post = m._forward_hooks.get(st._post_forward_hook_handle.id)
                in_place &= pre is not None and post is not None and pre != st._pre_forward
                in_place &= post != st._post_forward
        train_step(model, opt, make_batch(1, BATCH, WIDTH, rank))
        logged = tracker.recorder.logged
        tracker.step()
        errors += tracker.errors_total
    states: dict[str, list[str]] = {}
    for key, state in logged:
        if state in _FORWARD:
            states.setdefault(key, []).append(state)
    fingerprints["one"] = fsdp_fingerprint(model, opt)

    # two trackers on one model at once, detached first-attached first, then last first
    for order in ("fifo", "lifo"):
        a = FSDPMemoryTracker(model, opt).attach()
        b = FSDPMemoryTracker(model, opt).attach()
        for step in range(2):
            train_step(model, opt, make_batch(2 + step, BATCH, WIDTH, rank))
            a.step()
            b.step()
        first, second = (a, b) if order == "fifo" else (b, a)
        first.detach()
        train_step(model, opt, make_batch(4, BATCH, WIDTH, rank))  # the other one still attached
        second.step()
        second.detach()
        errors += a.errors_total + b.errors_total
        fingerprints[order] = fsdp_fingerprint(model, opt)
    return HooksResult(before=before, during=during, fsdp_hooks_in_place=in_place, forward_states=states,
                       fingerprints=fingerprints, errors=errors)


@dataclass(frozen=True)
class UpstreamResult:
    missing: dict[str, list[str]]  # per step after upstream's: modules without all four forward states
    counts_after: dict[str, tuple[int, int]]  # hook counts after our detach
    before: dict[str, tuple[int, int]]
    errors: int


def upstream_replaces_hooks(opts_dict: dict[str, Any]) -> UpstreamResult:
    """Upstream FSDPMemTracker entered while ours is attached: it removes FSDP's forward hooks
    (ours, wrapped in place) and registers its own; ours must take the states over."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))
    before = _hooks(model)
    missing: dict[str, list[str]] = {}
    with FSDPMemoryTracker(model, opt) as tracker:
        for step in range(4):
            if step == 1:
                with FSDPMemTracker(model, opt):
                    train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
            else:
                train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
            states: dict[str, list[str]] = {}
            for key, state in tracker.recorder.logged:
                if state in _FORWARD:
                    states.setdefault(key, []).append(state)
            missing[f"step{step}"] = sorted(k for k in before if states.get(k) != _FORWARD)
            tracker.step()
        errors = tracker.errors_total
    return UpstreamResult(missing=missing, counts_after=_hooks(model), before=before, errors=errors)


@dataclass(frozen=True)
class SpanResult:
    # step -> FSDP module (the model itself aside) -> (state, its group unsharded then) per forward state
    seen: dict[int, dict[str, list[tuple[str, bool]]]]
    counts: dict[str, tuple[int, int]]  # hook counts in the last step
    before: dict[str, tuple[int, int]]
    counts_after: dict[str, tuple[int, int]]  # after our detach
    errors: int


def upstream_spans_steps(opts_dict: dict[str, Any]) -> SpanResult:
    """Upstream FSDPMemTracker entered at step 1 and left at step 3 while ours stays attached:
    FSDP's forward hooks are re-registered twice under ours (upstream's around FSDP's, then FSDP's
    own again, prepended and appended); from the step after each change, ours must stand around
    them again. The oracle is FSDP's own state at each state event of ours: a module's group is
    sharded at before_pre_forward, unsharded at after_pre_forward and before_post_forward, and
    resharded at after_post_forward (reshard_after_forward=True)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fsdp_mem_otel.training.adapters.fsdp2 import param_groups

    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))
    before = _hooks(model)
    groups = {path: param_groups(m)[0] for path, m in model.named_modules() if path and hasattr(m, "_get_fsdp_state")}
    seen: dict[int, dict[str, list[tuple[str, bool]]]] = {}
    upstream = FSDPMemTracker(model, opt)
    with FSDPMemoryTracker(model, opt) as tracker:
        record = tracker._sink.on_state

        def on_state(key: str, state: str, *args: Any) -> None:
            if state in _FORWARD and key in groups:
                seen[step].setdefault(key, []).append((state, groups[key].is_unsharded))
            record(key, state, *args)

        tracker._sink.on_state = on_state  # type: ignore[method-assign]
        for step in range(6):
            if step == 1:
                upstream.__enter__()
            elif step == 2:
                upstream.reset_mod_stats()  # it measures one iteration at a time
            elif step == 3:
                upstream.__exit__(None, None, None)
            seen[step] = {}
            train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
            counts = _hooks(model)
            tracker.step()
        errors = tracker.errors_total
    return SpanResult(seen=seen, counts=counts, before=before, counts_after=_hooks(model), errors=errors)


@pytest.fixture(scope="module")
def spans() -> list[SpanResult]:
    return run_ranks(upstream_spans_steps, {"fsdp": 2})


def test_hooks_of_ours_stand_around_fsdps_again_after_each_change(spans: list[SpanResult], rank: int) -> None:
    res = spans[rank]
    expected = list(zip(_FORWARD, [False, True, True, False], strict=True))
    for step in (0, 2, 4, 5):  # 1 and 3: the steps in which FSDP's hooks changed (the first logged)
        assert res.seen[step] and set(res.seen[step]) == set(res.before) - {"<root>"}, step
        for key, states in res.seen[step].items():
            assert states == expected, (step, key)
    for path, (pre, post) in res.before.items():  # FSDP's own again: wrapped in place again
        assert res.counts[path] == ((pre + 2, post + 2) if path == "<root>" else (pre, post + 1)), path
    assert res.counts_after == res.before
    assert res.errors == 0


@pytest.fixture(scope="module")
def upstream() -> list[UpstreamResult]:
    return run_ranks(upstream_replaces_hooks, {"fsdp": 2})


def test_hooks_of_ours_take_over_when_someone_replaces_fsdps(upstream: list[UpstreamResult], rank: int) -> None:
    res = upstream[rank]
    assert res.missing["step0"] == []
    # the step after upstream's: ours noticed at its first forward's end; from the next step on, all states again
    assert res.missing["step3"] == []
    assert res.counts_after == res.before  # nothing of ours left (upstream re-registered FSDP's own)
    assert res.errors == 0


@pytest.fixture(scope="module")
def hooks() -> list[HooksResult]:
    return run_ranks(forward_hooks, {"fsdp": 2})


def test_fsdp2_forward_hooks_are_wrapped_in_place_and_put_back(hooks: list[HooksResult], rank: int) -> None:
    res = hooks[rank]
    assert res.before and res.during.keys() == res.before.keys()
    for path, (pre, post) in res.before.items():
        if path == "<root>":  # the model itself keeps four hooks of ours (automatic attachment)
            assert res.during[path] == (pre + 2, post + 2), path
            continue
        # FSDP's pre-hook replaced in its place, no hook of ours added; one always-call hook after its post-hook
        assert res.during[path] == (pre, post + 1), path
    assert res.fsdp_hooks_in_place
    assert set(res.forward_states) == set(res.before)
    for path, states in res.forward_states.items():
        assert states == _FORWARD, path
    for order in ("one", "fifo", "lifo"):
        assert res.fingerprints[order] == res.fingerprints["before"], order
    assert res.errors == 0
