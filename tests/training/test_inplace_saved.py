"""A saved activation changed in place inside an FSDP module: autograd raises at backward, and must
still raise with light mode's saved-tensor hooks set (they turn autograd's own version check off:
without a check of ours, the tracker would turn the error into wrong gradients)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks


class _SigmoidThenScaledInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.lin(x))  # sigmoid saves its output for backward
        h.mul_(2)  # ... which this changes: a user's bug autograd reports
        return h


def _wrapped(fsdp: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(_SigmoidThenScaledInPlace(), nn.Linear(8, 1))
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))


def backward_errors(fsdp: int) -> dict[str, Any]:
    """The error backward raises, untracked and under a light tracker, on the same model."""
    out: dict[str, Any] = {}
    for run in ("untracked", "tracked"):
        model = _wrapped(fsdp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tracker = FSDPMemoryTracker(model, opt, mode="light").attach() if run == "tracked" else None
        try:
            model(torch.randn(4, 8)).sum().backward()
            out[run] = None
        except RuntimeError as exc:
            out[run] = str(exc)
        if tracker is not None:
            out["tracker_errors"] = tracker.errors_total
            tracker.detach()
    return out


@pytest.mark.parametrize("fsdp", [1, 2], ids=["fsdp1", "fsdp2"])
def test_an_in_place_change_of_a_saved_activation_raises_under_the_tracker(fsdp: int) -> None:
    (got,) = run_ranks(backward_errors, fsdp, world_size=1)
    assert got["untracked"] is not None and "modified by an inplace operation" in got["untracked"]
    assert got["tracked"] is not None and "modified by an inplace operation" in got["tracked"], got["tracked"]
    assert got["tracker_errors"] == 0
