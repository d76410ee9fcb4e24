"""Shared fixtures: distributed runs are expensive (two spawned ranks), so each runs once per session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dist import RANKS, run_ranks
from tests.scenarios import FSDP1_ONLY, SCENARIOS, RunResult, run_configs


@pytest.fixture(autouse=True)
def _no_saved_tensor_hooks_left() -> Iterator[None]:
    """No test leaves saved-tensor hooks pushed on the test process's thread: the tracker's would
    run in every later test (checked only where a test imported torch)."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()  # the next test starts clean
        pytest.fail("saved-tensor hooks left pushed on the test process's thread")


def _configs(fsdp: int) -> dict[str, dict[str, Any]]:
    scenarios = dict(SCENARIOS)
    if fsdp == 1:
        scenarios.update(FSDP1_ONLY)
    return {name: {"opts_dict": {**wrap, "fsdp": fsdp}, **train} for name, (wrap, train) in scenarios.items()}


def _run(fsdp: int) -> list[dict[str, RunResult]]:
    configs = _configs(fsdp)
    per_rank = run_ranks(run_configs, list(configs.values()), timeout=600)
    return [dict(zip(configs, rank_results, strict=True)) for rank_results in per_rank]


@pytest.fixture(scope="session")
def fsdp2_runs() -> list[dict[str, RunResult]]:
    """Per rank: scenario name -> run_config() result, FSDP2."""
    return _run(2)


@pytest.fixture(scope="session")
def fsdp1_runs() -> list[dict[str, RunResult]]:
    """Per rank: scenario name -> run_config() result, FSDP1."""
    return _run(1)


@pytest.fixture(params=[1, 2], ids=["fsdp1", "fsdp2"])
def runs(request: pytest.FixtureRequest) -> list[dict[str, RunResult]]:
    return request.getfixturevalue(f"fsdp{request.param}_runs")


@pytest.fixture(params=RANKS, ids=[f"rank{r}" for r in RANKS])
def rank(request: pytest.FixtureRequest) -> int:
    """Each rank of a run_ranks() result in a test of its own (the run itself is a shared fixture)."""
    return int(request.param)


@pytest.fixture(scope="session")
def one_rank_nccl() -> Any:
    """A 1-rank NCCL group on GPU 0 for the CUDA tests (they skip without a GPU; CI has none)."""
    import torch.distributed as dist

    from tests.cuda_llama import init_one_rank_nccl

    init_one_rank_nccl()
    yield
    dist.destroy_process_group()
