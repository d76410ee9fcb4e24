"""StepReport is plain data: JSON round-trips, no torch objects."""

import json

from fsdp_mem_otel.schema import CATEGORY_KEYS, STATES, ModuleReport, StepReport, empty_breakdown


def _report() -> StepReport:
    snap = {"cpu": empty_breakdown()}
    snap["cpu"]["activation"] = 10
    snap["cpu"]["total"] = 10
    return StepReport(
        step=1, rank=0, world_size=2, mode="light", fsdp_version=2, peak=snap,
        modules={"<root>": ModuleReport({"before_pre_forward": [snap, snap]})}, module_order=["<root>"],
    )


def test_to_dict_round_trips_through_json() -> None:
    r = _report()
    d = json.loads(json.dumps(r.to_dict()))
    assert StepReport.from_dict(d) == r
    assert d["peak"]["cpu"]["activation"] == 10
    assert len(d["modules"]["<root>"]["snapshots"]["before_pre_forward"]) == 2


def test_vocabulary_matches_design() -> None:
    assert CATEGORY_KEYS == (
        "sharded_param", "unsharded_param", "buffer", "sharded_grad", "unsharded_grad", "activation",
        "temp", "all_gather", "reduce_scatter", "optimizer_state", "inputs", "total",
    )
    assert STATES == (
        "before_pre_forward", "after_pre_forward", "before_post_forward", "after_post_forward",
        "before_pre_backward", "after_pre_backward", "before_post_backward", "after_post_backward",
        "pre_forward_ac", "post_forward_ac", "peak_forward", "peak_backward",
    )
