"""Light mode's per-group accounts (FSDP2 buffers as integers moved by FSDP's own events) against
deep mode on the very same steps, over the FSDP2 configurations whose buffers they model.

A light tracker and a deep one are attached to the same model (the deep one accounts every op's
storages, and FSDP's buffers per tensor): at every module state of every step, each category FSDP
owns (and the others light mode counts exactly) must be equal, and no group may have fallen back to
per-tensor accounting, except in the configuration built to make one fall back (a Linear used on
odd steps only). There light mode learns of the change when the group's reduce-scatter input comes
out smaller than the one it learnt, after that group's post-backward: the step in which it happens
counts the fallback, and every step after it must be equal again. 2 real gloo ranks (4 for
``reshard_after_forward=2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_mem_otel.schema import STATES
from fsdp_mem_otel.tools.demo import Block, BlockModel, make_batch
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import RANKS, run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH, settle

STEPS = 3
EXACT_IN_LIGHT = ("sharded_param", "unsharded_param", "buffer", "sharded_grad", "unsharded_grad",
                  "all_gather", "reduce_scatter", "optimizer_state", "inputs")
COMPARED_STATES = STATES[:10]  # the 8 boundary states and the checkpoint-recompute ones

# name -> how the model is built and trained (see _build and _train)
CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "grouped": {"grouped": True},
    "hsdp_replicate_only": {"mesh": (2, 1)},
    "hsdp_sharded": {"mesh": (1, 2)},
    "mixed_precision": {"mp": True},
    "accumulation_without_sync": {"micro_batches": 2, "no_sync_first": True},
    "mixed_precision_accumulation_without_sync": {"mp": True, "micro_batches": 2, "no_sync_first": True},
    "accumulation_with_sync": {"micro_batches": 2},
    "ignored_params": {"ignored_head": True},
    "cpu_offload": {"offload": True},
    "frozen_params": {"frozen_fc1": True},
    "unused_params": {"unused": True},
    "explicit_prefetch": {"prefetch": True},
    "no_reshard_after_forward": {"reshard_after_forward": False},
    "sometimes_unused": {"sometimes_unused": True},  # falls back, figures still exact
}


class _UnusedBlock(Block):
    """A block with a Linear its forward uses never, or only on odd calls."""

    def __init__(self, width: int, sometimes: bool) -> None:
        super().__init__(width)
        self.spare = nn.Linear(width, width)
        self.sometimes = sometimes
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = super().forward(x)
        return out + self.spare(x) if self.sometimes and self.calls % 2 else out


def _build(cfg: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = BlockModel(BLOCKS, WIDTH)
    if cfg.get("unused") or cfg.get("sometimes_unused"):
        model.layers = nn.ModuleList(_UnusedBlock(WIDTH, bool(cfg.get("sometimes_unused"))) for _ in range(BLOCKS))
    if cfg.get("frozen_fc1"):
        for block in model.layers:
            block.fc1.requires_grad_(False)
    kwargs: dict[str, Any] = {"reshard_after_forward": cfg.get("reshard_after_forward", True)}
    if "mesh" in cfg:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", cfg["mesh"], mesh_dim_names=("replicate", "shard"))
    if cfg.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.layers:
        if cfg.get("grouped"):
            fully_shard([block.fc1, block.fc2], **kwargs)
        fully_shard(block, **kwargs)
    root_kwargs = dict(kwargs, reshard_after_forward=True)
    if cfg.get("ignored_head"):
        root_kwargs["ignored_params"] = set(model.head.parameters())
    fully_shard(model, **root_kwargs)
    if cfg.get("prefetch"):
        layers = list(model.layers)
        for i, layer in enumerate(layers[:-1]):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])  # type: ignore[operator]
        for i, layer in enumerate(layers[1:], start=1):
            layer.set_modules_to_backward_prefetch([layers[i - 1]])  # type: ignore[operator]
    return model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)


@dataclass
class LightVsDeep:
    light: list[dict[str, Any]]
    deep: list[dict[str, Any]]
    errors: int


def light_vs_deep(cfg: dict[str, Any]) -> LightVsDeep:
    """Rank body: STEPS steps under a light and a deep tracker on one model."""
    rank = torch.distributed.get_rank()
    model, opt = _build(cfg)
    light = FSDPMemoryTracker(model, opt).attach()
    deep = FSDPMemoryTracker(model, opt, mode="deep").attach()
    micro = cfg.get("micro_batches", 1)
    light_reports, deep_reports = [], []
    for step in range(STEPS):
        settle()
        opt.zero_grad(set_to_none=True)
        x = make_batch(step, BATCH, WIDTH, rank)
        for i, chunk in enumerate(x.chunk(micro)):
            if cfg.get("no_sync_first"):
                model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
            light.track_inputs(chunk)
            deep.track_inputs(chunk)
            model(chunk).float().pow(2).mean().backward()
        opt.step()
        light_reports.append(light.step().to_dict())
        deep_reports.append(deep.step().to_dict())
    light.detach()
    deep.detach()
    return LightVsDeep(light_reports, deep_reports, light.errors_total + deep.errors_total)


def light_vs_deep_all(configs: list[dict[str, Any]]) -> list[LightVsDeep]:
    return [light_vs_deep(cfg) for cfg in configs]


def reshard_to_two() -> LightVsDeep:
    """Rank body (4 ranks): blocks reshard to groups of 2 after forward (post-forward shards)."""
    from torch.distributed.fsdp import fully_shard

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = BlockModel(BLOCKS, WIDTH)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=2)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    light = FSDPMemoryTracker(model, opt).attach()
    deep = FSDPMemoryTracker(model, opt, mode="deep").attach()
    light_reports, deep_reports = [], []
    for step in range(STEPS):
        settle()
        opt.zero_grad(set_to_none=True)
        model(make_batch(step, BATCH, WIDTH, rank)).pow(2).mean().backward()
        opt.step()
        light_reports.append(light.step().to_dict())
        deep_reports.append(deep.step().to_dict())
    light.detach()
    deep.detach()
    return LightVsDeep(light_reports, deep_reports, light.errors_total + deep.errors_total)


@pytest.fixture(scope="module")
def runs() -> list[dict[str, LightVsDeep]]:
    per_rank = run_ranks(light_vs_deep_all, list(CONFIGS.values()), timeout=900)
    return [dict(zip(CONFIGS, results, strict=True)) for results in per_rank]


def _differences(light: dict[str, Any], deep: dict[str, Any]) -> list[tuple[Any, ...]]:
    out = []
    assert (light["mode"], deep["mode"]) == ("light", "deep")
    for key, mod in deep["modules"].items():
        for state in COMPARED_STATES:
            d_calls = mod["snapshots"].get(state, [])
            l_calls = light["modules"].get(key, {}).get("snapshots", {}).get(state, [])
            assert len(l_calls) == len(d_calls), (key, state)
            for lc, dc in zip(l_calls, d_calls, strict=True):
                for dev, cats in dc.items():
                    for cat in EXACT_IN_LIGHT:
                        if lc.get(dev, {}).get(cat, 0) != cats[cat]:
                            out.append((light["step"], key, state, dev, cat, lc.get(dev, {}).get(cat, 0), cats[cat]))
    for part in ("current",):
        for dev, cats in deep[part].items():
            for cat in EXACT_IN_LIGHT:
                if light[part].get(dev, {}).get(cat, 0) != cats[cat]:
                    out.append((light["step"], part, dev, cat, light[part].get(dev, {}).get(cat, 0), cats[cat]))
    return out


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_light_groups_equal_deep_at_every_state(runs: list[dict[str, LightVsDeep]], name: str, rank: int) -> None:
    run = runs[rank][name]
    assert run.errors == 0
    fallbacks = [r["fallback_groups"] for r in run.light]
    exact = list(zip(run.light, run.deep, strict=True))
    if name == "sometimes_unused":  # gradients that change from step to step: learnt at step 2
        assert fallbacks == [0, BLOCKS, BLOCKS]
        exact = exact[:1] + exact[2:]
    else:
        assert fallbacks == [0] * STEPS
    for light, deep in exact:
        assert _differences(light, deep) == []


def test_post_forward_shards_equal_deep() -> None:
    for run in run_ranks(reshard_to_two, world_size=4, timeout=600):
        assert run.errors == 0
        for light, deep in zip(run.light, run.deep, strict=True):
            assert _differences(light, deep) == []
            assert light["fallback_groups"] == 0
