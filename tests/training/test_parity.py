"""Deep mode against upstream FSDPMemTracker on the same FSDP2 training steps, and light vs deep.

gloo frees a reduce-scatter's staging copy on its own thread, sometimes after the next op; that
can move the instant of a backward peak, so that our window (which encloses upstream's) and
upstream's find their maxima at different instants (seen once in about four CI runs: layers.1's
activation at its backward peak 20,744 vs 12,424 bytes). Each of PARITY_STEPS steps is compared
in full at the usual tolerance, and most of them must agree with upstream: a systematic
difference shows in every step, the race in a few.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.schema import CATEGORY_KEYS, TOTAL
from fsdp_mem_otel.training.demo import WrapOptions, build, make_batch, train_step
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH, step_under_upstream, upstream_snapshot
from tests.training.test_tracking import _compare_light_to_deep


@dataclass(frozen=True)
class ParityResult:
    deep: dict[str, Any]  # our deep tracker's StepReport.to_dict()
    light: dict[str, Any]  # our light tracker's, same step
    upstream_peak: dict[str, dict[str, int]]  # upstream's step peak, device -> category -> bytes
    upstream_modules: dict[str, dict[str, list[dict[str, dict[str, int]]]]]  # module -> state -> calls
    errors: int  # both our trackers' errors_total


PARITY_STEPS = 5


def parity_with_upstream(opts_dict: dict[str, Any]) -> list[ParityResult]:
    """After one warm-up step, measure PARITY_STEPS steps, each with a fresh upstream
    FSDPMemTracker, our deep tracker and our light tracker all at once."""
    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    x = make_batch(0, BATCH, WIDTH, rank)
    train_step(model, opt, x)
    return [_one_step(model, opt, x) for _ in range(PARITY_STEPS)]


def _one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> ParityResult:
    """One step under upstream's tracker and ours, the very same step."""
    light_report, deep_report, upstream, errors, _ = step_under_upstream(model, opt, x,
                                                                          lambda: train_step(model, opt, x))
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
        errors=errors,
    )


@pytest.fixture(scope="module")
def parity() -> list[list[ParityResult]]:
    """Per rank, the measured steps."""
    return run_ranks(parity_with_upstream, {"fsdp": 2})


def _most_steps_agree(differences: list[list[Any]]) -> None:
    differing = [d for d in differences if d]
    assert len(differing) < len(differences) / 2, differing


def _step_peak_differences(res: ParityResult) -> list[Any]:
    ours, theirs = res.deep["peak"]["cpu"], res.upstream_peak["cpu"]
    tolerance = 0.01 * theirs[TOTAL]
    return [(cat, ours[cat], theirs[cat]) for cat in CATEGORY_KEYS if abs(ours[cat] - theirs[cat]) > tolerance]


def test_step_peak_matches_upstream_per_category(parity: list[list[ParityResult]], rank: int) -> None:
    _most_steps_agree([_step_peak_differences(res) for res in parity[rank]])
    assert all(res.errors == 0 for res in parity[rank])


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


def _backward_slack(cat: str, shard: int) -> int:
    """What a backward peak's category may differ from upstream's by, beyond the tolerance. The
    staging copy gloo frees late is one module's unsharded gradient (2 shards on 2 ranks); where
    it makes two instants' totals tie within the tolerance, our window (wider than upstream's) and
    upstream's can pick different instants, whose other categories differ by up to that much."""
    return shard if cat in (*_ASYNC, TOTAL) else 2 * shard


def _module_peak_differences(res: ParityResult) -> list[Any]:
    tolerance = 0.01 * res.upstream_peak["cpu"][TOTAL]
    shard = _grad_shard(res.deep)
    assert set(res.upstream_modules) == set(res.deep["module_order"])
    compared = 0
    differences = []
    for key, states in res.upstream_modules.items():
        for up_state, ours_state in (("Peak Forward", "peak_forward"), ("Peak Backward", "peak_backward")):
            theirs = states[up_state]
            ours = res.deep["modules"][key]["snapshots"][ours_state]
            assert len(ours) == len(theirs) == 1, (key, ours_state)
            for cat in CATEGORY_KEYS:
                a, b = ours[0]["cpu"][cat], theirs[0]["cpu"][cat]
                slack = _backward_slack(cat, shard) if ours_state == "peak_backward" else 0
                if abs(a - b) > tolerance + slack:
                    differences.append((key, ours_state, cat, a, b))
                compared += 1
    assert compared == len(res.upstream_modules) * 2 * len(CATEGORY_KEYS)
    return differences


def test_module_peaks_match_upstream(parity: list[list[ParityResult]], rank: int) -> None:
    _most_steps_agree([_module_peak_differences(res) for res in parity[rank]])


def test_light_exact_categories_match_deep_on_the_same_step(parity: list[list[ParityResult]], rank: int) -> None:
    for res in parity[rank]:  # both ours, the same windows: every step
        assert _compare_light_to_deep(res.light, res.deep) > 0
