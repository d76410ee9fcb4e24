"""Deep mode against upstream FSDPMemTracker on the same FSDP2 training step, and light vs deep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.schema import CATEGORY_KEYS, TOTAL
from fsdp_mem_otel.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH, settle, upstream_snapshot
from tests.test_tracking import _compare_light_to_deep


@dataclass(frozen=True)
class ParityResult:
    deep: dict[str, Any]  # our deep tracker's StepReport.to_dict()
    light: dict[str, Any]  # our light tracker's, same step
    upstream_peak: dict[str, dict[str, int]]  # upstream's step peak, device -> category -> bytes
    upstream_modules: dict[str, dict[str, list[dict[str, dict[str, int]]]]]  # module -> state -> calls
    errors: int  # both our trackers' errors_total


def parity_with_upstream(opts_dict: dict[str, Any]) -> ParityResult:
    """After one warm-up step, measure one step with upstream FSDPMemTracker, our deep tracker and
    our light tracker all at once (ours attached inside upstream's context, so our hooks run
    first and our windows enclose upstream's): the three see the very same step.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    x = make_batch(0, BATCH, WIDTH, rank)
    train_step(model, opt, x)

    settle()
    upstream = FSDPMemTracker(model, opt)
    upstream.track_inputs((x,))
    with upstream:
        deep = FSDPMemoryTracker(model, opt, mode="deep").attach()
        light = FSDPMemoryTracker(model, opt, mode="light").attach()
        deep.track_inputs(x)
        light.track_inputs(x)
        train_step(model, opt, x)
        light_report, deep_report = light.step().to_dict(), deep.step().to_dict()
        light.detach()
        deep.detach()
    up_modules = {}
    for stats in upstream.memory_tracking.values():
        if not hasattr(stats, "snapshots"):
            continue
        key = stats.mod_fqn.split(".", 1)[1] if "." in stats.mod_fqn else "<root>"
        up_modules[key] = {
            state.value: [upstream_snapshot(s) for s in calls] for state, calls in stats.snapshots.items()
        }
    return ParityResult(
        deep=deep_report,
        light=light_report,
        upstream_peak=upstream_snapshot(upstream.get_tracker_snapshot("peak")),
        upstream_modules=up_modules,
        errors=deep.errors_total + light.errors_total,
    )


@pytest.fixture(scope="module")
def parity() -> list[ParityResult]:
    return run_ranks(parity_with_upstream, {"fsdp": 2})


def test_step_peak_matches_upstream_per_category(parity: list[ParityResult], rank: int) -> None:
    res = parity[rank]
    ours, theirs = res.deep["peak"]["cpu"], res.upstream_peak["cpu"]
    tolerance = 0.01 * theirs[TOTAL]
    for cat in CATEGORY_KEYS:
        assert abs(ours[cat] - theirs[cat]) <= tolerance, (cat, ours[cat], theirs[cat])
    assert res.errors == 0


def _grad_shard(deep: dict[str, Any]) -> int:
    """The largest gradient shard one module's post-backward adds (our deep report)."""
    out = 0
    for mod in deep["modules"].values():
        snaps = mod["snapshots"]
        if snaps.get("before_post_backward") and snaps.get("after_post_backward"):
            before = snaps["before_post_backward"][0]["cpu"]["sharded_grad"]
            after = snaps["after_post_backward"][0]["cpu"]["sharded_grad"]
            out = max(out, after - before)
    return out


#: at a backward peak, what gloo's asynchronous reduce-scatter moves: whether the next module's
#: gradient shard already exists at the peak instant differs between two runs (seen in CI)
_ASYNC = ("sharded_grad", "reduce_scatter", "temp")


def test_module_peaks_match_upstream(parity: list[ParityResult], rank: int) -> None:
    res = parity[rank]
    tolerance = 0.01 * res.upstream_peak["cpu"][TOTAL]
    shard = _grad_shard(res.deep)
    assert set(res.upstream_modules) == set(res.deep["module_order"])
    compared = 0
    for key, states in res.upstream_modules.items():
        for up_state, ours_state in (("Peak Forward", "peak_forward"), ("Peak Backward", "peak_backward")):
            theirs = states[up_state]
            ours = res.deep["modules"][key]["snapshots"][ours_state]
            assert len(ours) == len(theirs) == 1, (key, ours_state)
            for cat in CATEGORY_KEYS:
                a, b = ours[0]["cpu"][cat], theirs[0]["cpu"][cat]
                slack = shard if ours_state == "peak_backward" and cat in (*_ASYNC, TOTAL) else 0
                assert abs(a - b) <= tolerance + slack, (key, ours_state, cat, a, b)
                compared += 1
    assert compared == len(res.upstream_modules) * 2 * len(CATEGORY_KEYS)


def test_light_exact_categories_match_deep_on_the_same_step(parity: list[ParityResult], rank: int) -> None:
    res = parity[rank]
    assert _compare_light_to_deep(res.light, res.deep) > 0
