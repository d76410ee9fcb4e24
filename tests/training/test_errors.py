"""User mistakes give ValueError/TypeError naming the argument and what is accepted."""

import pytest
import torch
from torch import nn

from fsdp_mem_otel.training.tracker import FSDPMemoryTracker


def test_model_without_fsdp_is_rejected_with_what_is_supported() -> None:
    with pytest.raises(ValueError, match=r"no FSDP module; supported: FSDP2 .*fully_shard.* FSDP1"):
        FSDPMemoryTracker(nn.Linear(4, 4))


def test_non_module_model_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        FSDPMemoryTracker("model")  # type: ignore[arg-type]


def test_bad_optimizer_and_mode_name_the_argument() -> None:
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        FSDPMemoryTracker(nn.Linear(4, 4), optimizer=[1, 2])  # type: ignore[arg-type]
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="mode must be one of light, deep"):
        FSDPMemoryTracker(lin, torch.optim.SGD(lin.parameters(), lr=0.1), mode="verbose")
