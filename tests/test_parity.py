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


def test_module_peaks_match_upstream(parity: list[dict[str, Any]]) -> None:
    for res in parity:
        tolerance = 0.01 * res["upstream_peak"]["cpu"][TOTAL]
        assert set(res["upstream_modules"]) == set(res["deep"]["module_order"])
        compared = 0
        for key, states in res["upstream_modules"].items():
            for up_state, ours_state in (("Peak Forward", "peak_forward"), ("Peak Backward", "peak_backward")):
                theirs = states[up_state]
                ours = res["deep"]["modules"][key]["snapshots"][ours_state]
                assert len(ours) == len(theirs) == 1, (key, ours_state)
                for cat in CATEGORY_KEYS:
                    a, b = ours[0]["cpu"][cat], theirs[0]["cpu"][cat]
                    assert abs(a - b) <= tolerance, (key, ours_state, cat, a, b)
                    compared += 1
        assert compared == len(res["upstream_modules"]) * 2 * len(CATEGORY_KEYS)


def test_light_exact_categories_match_deep_on_the_same_step(parity: list[dict[str, Any]]) -> None:
    for res in parity:
        assert _compare_light_to_deep(res["light"], res["deep"]) > 0
