"""Shared fixtures: distributed runs are expensive (two spawned ranks), so each runs once per session."""

from __future__ import annotations

from typing import Any

import pytest

from tests import workers
from tests.dist import run_ranks

# name -> (wrap options, train options). Each runs 3 steps on 2 ranks under one spawn per generation.
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({}, {}),
    "grad_accumulation": ({}, {"micro_batches": 2}),
    "checkpoint_wrapper": ({"checkpoint": True}, {}),
    "inner_checkpoint": ({"inner_checkpoint": True}, {}),
    "repeat_first": ({"repeat_first": True}, {}),
    "no_reshard_after_forward": ({"reshard_after_forward": False}, {}),
    "nested": ({"nested": True}, {}),
    "nested_inner_checkpoint": ({"nested": True, "inner_checkpoint": True}, {}),
    "deep": ({}, {"mode": "deep"}),
    "deep_every_2": ({}, {"deep_every": 2, "steps": 4}),
    "light_with_deep_shadow": ({}, {"shadow_deep": True}),
    "ac_light_with_deep_shadow": ({"nested": True, "inner_checkpoint": True}, {"shadow_deep": True}),
}
FSDP1_ONLY: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "flat_params": ({"use_orig_params": False}, {}),
    "flat_params_deep": ({"use_orig_params": False}, {"mode": "deep"}),
}


def _configs(fsdp: int) -> dict[str, dict[str, Any]]:
    scenarios = dict(SCENARIOS)
    if fsdp == 1:
        scenarios.update(FSDP1_ONLY)
    return {name: {"opts_dict": {**wrap, "fsdp": fsdp}, **train} for name, (wrap, train) in scenarios.items()}


def _run(fsdp: int) -> list[dict[str, Any]]:
    configs = _configs(fsdp)
    per_rank = run_ranks(workers.run_configs, list(configs.values()), timeout=600)
    return [dict(zip(configs, rank_results, strict=True)) for rank_results in per_rank]


@pytest.fixture(scope="session")
def fsdp2_runs() -> list[dict[str, Any]]:
    """Per rank: scenario name -> run_config() result, FSDP2."""
    return _run(2)


@pytest.fixture(scope="session")
def fsdp1_runs() -> list[dict[str, Any]]:
    """Per rank: scenario name -> run_config() result, FSDP1."""
    return _run(1)


@pytest.fixture(params=[1, 2], ids=["fsdp1", "fsdp2"])
def runs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return request.getfixturevalue(f"fsdp{request.param}_runs")
