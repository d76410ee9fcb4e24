"""Odd but legal use: documented behaviour, clear errors, never a crash of training."""

from __future__ import annotations

import json

import pytest

from fsdp_mem_otel.schema import StepReport
from tests import workers
from tests.dist import run_ranks


@pytest.mark.parametrize("fsdp", [1, 2])
def test_edge_cases(fsdp: int) -> None:
    for res in run_ranks(workers.edge_cases, fsdp):
        # step() before any forward, and twice in a row: empty reports, counted steps
        assert [r["step"] for r in res["empty"]] == [1, 2]
        assert all(r["modules"] == {} and r["aborted"] is None for r in res["empty"])
        # step() from a second thread: a clear error naming the rule
        assert len(res["thread_error"]) == 1 and "thread that called attach()" in res["thread_error"][0]
        # module names with quotes, braces, backslashes, non-ASCII and newlines survive as keys
        expected = sorted(["<root>"] + [f"blocks.{n}" for n in workers.ODD_NAMES])
        assert sorted(res["keys"]) == expected == res["json_keys"]
        report = StepReport.from_dict(json.loads(json.dumps(res["report"])))
        assert report.step == 3 and sorted(report.modules) == expected
        assert res["errors"] == 0
        # an optimizer over parameters of another model: a clear error
        assert "optimizer does not optimize any parameter of model" in res["foreign_error"]


def test_no_tensor_data_leaves_the_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    needle = repr(workers.SENTINEL)[2:9]  # "1234567": any rendering of the sentinel value
    for res in run_ranks(workers.no_tensor_data, str(tmp_path)):
        for exporter, text in res.items():
            assert text, exporter  # each exporter did emit
            assert needle not in text, exporter
