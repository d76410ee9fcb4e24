"""Deep mode against upstream FSDPMemTracker on the same FSDP2 training step, and light vs deep."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_mem_otel.schema import CATEGORY_KEYS, TOTAL
from tests import workers
from tests.dist import run_ranks
from tests.test_tracking import _compare_light_to_deep


@pytest.fixture(scope="module")
def parity() -> list[dict[str, Any]]:
    return run_ranks(workers.parity_with_upstream, {"fsdp": 2})


def test_step_peak_matches_upstream_per_category(parity: list[dict[str, Any]]) -> None:
    for res in parity:
        ours, theirs = res["deep"]["peak"]["cpu"], res["upstream_peak"]["cpu"]
        tolerance = 0.01 * theirs[TOTAL]
        for cat in CATEGORY_KEYS:
            assert abs(ours[cat] - theirs[cat]) <= tolerance, (cat, ours[cat], theirs[cat])
        assert res["errors"] == 0


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


def test_module_peaks_match_upstream(parity: list[dict[str, Any]]) -> None:
    for res in parity:
        tolerance = 0.01 * res["upstream_peak"]["cpu"][TOTAL]
        shard = _grad_shard(res["deep"])
        assert set(res["upstream_modules"]) == set(res["deep"]["module_order"])
        compared = 0
        for key, states in res["upstream_modules"].items():
            for up_state, ours_state in (("Peak Forward", "peak_forward"), ("Peak Backward", "peak_backward")):
                theirs = states[up_state]
                ours = res["deep"]["modules"][key]["snapshots"][ours_state]
                assert len(ours) == len(theirs) == 1, (key, ours_state)
                for cat in CATEGORY_KEYS:
                    a, b = ours[0]["cpu"][cat], theirs[0]["cpu"][cat]
                    slack = shard if ours_state == "peak_backward" and cat in (*_ASYNC, TOTAL) else 0
                    assert abs(a - b) <= tolerance + slack, (key, ours_state, cat, a, b)
                    compared += 1
        assert compared == len(res["upstream_modules"]) * 2 * len(CATEGORY_KEYS)


def test_light_exact_categories_match_deep_on_the_same_step(parity: list[dict[str, Any]]) -> None:
    for res in parity:
        assert _compare_light_to_deep(res["light"], res["deep"]) > 0
