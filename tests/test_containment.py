"""The tracker never breaks training: its own failures are logged once, counted, and survived."""

from __future__ import annotations

import pytest

from tests import workers
from tests.dist import run_ranks


@pytest.mark.parametrize("fsdp", [1, 2])
def test_internal_failures_are_contained(fsdp: int) -> None:
    for res in run_ranks(workers.containment, {"fsdp": fsdp}):
        assert res["tracked"] == res["untracked"]  # training unchanged, bit for bit
        assert res["errors_total"] > 2  # the injected ledger failures and the 2 exporter faults
        assert res["logged"] == 1  # one log line for one kind of failure
        # an exporter that raises: counted, logged once, the other exporters unaffected, and it
        # gets every later report once the fault clears
        assert res["exporter_logged"] == 1
        assert res["flaky_received"] == [-1, -2, 3, 4]
        assert res["recorded_steps"] == [1, 2, 3, 4]


def test_tracker_disables_itself_after_max_errors() -> None:
    for res in run_ranks(workers.disable_after_errors, {"fsdp": 2}):
        assert res["disabled"] and not res["attached"]
        assert res["errors_total"] >= 5
        assert res["exporter_broken"] == [False, 5]  # counted, but measuring stays on
