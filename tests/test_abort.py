"""An OOM in the middle of a step: the report says where it happened and what memory held."""

from __future__ import annotations

import pytest

from fsdp_mem_otel.schema import TOTAL
from tests import workers
from tests.dist import run_ranks


@pytest.mark.parametrize(("where", "state"), [("forward", "after_pre_forward"), ("backward", "after_pre_backward")])
def test_oom_inside_a_module_is_located_and_training_goes_on(where: str, state: str) -> None:
    # FSDP2 only: FSDP1 has no supported recovery (reset_iter_state) after a mid-step exception.
    for reports in run_ranks(workers.oom_mid_step, {"fsdp": 2}, where):
        ok, failed, *after = reports
        assert ok["aborted"] is None
        abort = failed["aborted"]
        assert abort["error"] == "OutOfMemoryError" and abort["oom"]
        assert abort["module"] == "layers.1" and abort["state"] == state
        live = abort["breakdown"]["cpu"]
        # layers.1 was unsharded when it failed: its full parameters are in the breakdown
        assert live["unsharded_param"] >= workers.block_param_bytes()
        assert failed["peak"]["cpu"][TOTAL] >= live[TOTAL]
        for rep in after:  # tracked normally again
            assert rep["aborted"] is None and rep["errors_total"] == 0
            assert all(len(m["snapshots"]["after_post_backward"]) == 1 for m in rep["modules"].values())
