"""Left on for thousands of steps, the tracker's own memory stays flat."""

from __future__ import annotations

from tests import workers
from tests.dist import run_ranks

LIGHT_STEPS, DEEP_STEPS = 2000, 200


def test_tracker_memory_is_flat_over_a_long_run() -> None:
    for res in run_ranks(workers.soak, LIGHT_STEPS, DEEP_STEPS, timeout=600):
        light_early, light_late, deep_early, deep_late = res["samples"]
        for early, late in ((light_early, light_late), (deep_early, deep_late)):
            assert late["step"] - early["step"] >= 0.8 * (LIGHT_STEPS if early["mode"] == "light" else DEEP_STEPS)
            # the tracker's tables do not grow with the number of steps
            for table in ("ledger", "opt_tensors", "windows", "logged", "series"):
                assert late[table] == early[table], (early["mode"], table, early[table], late[table])
            assert late["errors"] == 0
            # nor does the process: well under what keeping one report per step would cost
            assert late["rss"] - early["rss"] < 8 * 2**20, (early["mode"], late["rss"] - early["rss"])
