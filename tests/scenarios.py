"""The training scenarios the session fixtures in tests/conftest.py run on 2 real ranks, and the
rank body that runs them (here, not in conftest.py: spawned ranks import it by module path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.oracles import (
    BATCH,
    BLOCKS,
    WIDTH,
    block_param_bytes,
    grad_bytes,
    optimizer_state_bytes,
    settle,
    sharded_param_bytes,
)

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


def scenario_names(fsdp: int) -> list[str]:
    """The scenarios run for FSDP generation ``fsdp``."""
    return list(SCENARIOS) + (list(FSDP1_ONLY) if fsdp == 1 else [])


@dataclass(frozen=True)
class Oracle:
    """What the model and optimizer hold after the last step, by numel x element size."""

    sharded_param: int
    optimizer_state: int
    sharded_grad: int
    block_params: int  # one Block's unsharded parameters
    param_names: list[str]


@dataclass(frozen=True)
class RunResult:
    """One scenario on one rank: the tracker's reports (StepReport.to_dict()) and the oracles."""

    keys: list[str]
    reports: list[dict[str, Any]]
    shadow_reports: list[dict[str, Any]]  # the deep shadow tracker's, with shadow_deep
    errors_total: int
    oracle: Oracle


def run_config(opts_dict: dict[str, Any], steps: int = 3, micro_batches: int = 1, mode: str = "light",
               deep_every: int = 0, shadow_deep: bool = False) -> RunResult:
    """Train ``steps`` steps under the tracker; return reports and oracles.

    ``shadow_deep`` attaches a second, deep-mode tracker to the same model, so both measure the
    very same steps (for comparing light mode with deep mode).
    """
    opts = WrapOptions(**opts_dict)
    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, opts)
    tracker = FSDPMemoryTracker(model, opt, mode=mode, deep_every=deep_every)
    shadow = FSDPMemoryTracker(model, opt, mode="deep") if shadow_deep else None
    reports, shadow_reports = [], []
    with tracker:
        if shadow is not None:
            shadow.attach()
        for step in range(steps):
            settle()
            x = make_batch(step, BATCH, WIDTH, rank)
            if shadow is not None:
                shadow.track_inputs(x)
            train_step(model, opt, x, micro_batches=micro_batches, on_inputs=tracker.track_inputs)
            reports.append(tracker.step().to_dict())
            if shadow is not None:
                shadow_reports.append(shadow.step().to_dict())
        if shadow is not None:
            shadow.detach()
    return RunResult(
        keys=tracker.module_keys,
        reports=reports,
        shadow_reports=shadow_reports,
        errors_total=tracker.errors_total + (shadow.errors_total if shadow else 0),
        oracle=Oracle(
            sharded_param=sharded_param_bytes(model),
            optimizer_state=optimizer_state_bytes(opt),
            sharded_grad=grad_bytes(model),
            block_params=block_param_bytes(),
            param_names=[n for n, _ in model.named_parameters()],
        ),
    )


def run_configs(configs: list[dict[str, Any]]) -> list[RunResult]:
    return [run_config(**c) for c in configs]
