"""The tracker under torch.compile: 2 real FSDP2 ranks, compiled per block (torchtitan's way) and
as a whole, against the same compiled training without the tracker.

Oracles: the untracked compiled run of the same model (losses and parameters bitwise, dynamo's
own counters of compiles and graph breaks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_mem_otel.schema import DEEP_SKIPPED_COMPILED, STATES
from fsdp_mem_otel.tools.demo import BlockModel, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks

BLOCKS, WIDTH, BATCH, STEPS = 2, 32, 8, 4
BOUNDARY_STATES = STATES[:8]

# name -> (how blocks are compiled, how the whole model is, fullgraph, backend)
VARIANTS: dict[str, tuple[str, str, bool, str]] = {
    # torchtitan: block.compile(fullgraph=True) then fully_shard(block); inductor, as in production
    "block_inplace_fullgraph": ("inplace", "", True, "inductor"),
    "block_inplace_graph_breaks_allowed": ("inplace", "", False, "aot_eager"),
    "block_wrapper": ("wrapper", "", False, "aot_eager"),
    "whole_model": ("", "wrapper", False, "aot_eager"),
    "whole_model_inplace": ("", "inplace", False, "aot_eager"),
    # the tracker holds the inner model, which only a compiled caller runs (below)
    "outer_model_inner_tracked": ("", "wrapper", False, "aot_eager"),
    "compiled_forward_fn_inner_tracked": ("", "function", False, "aot_eager"),
}
#: variants whose tracker is given the inner model, not what the training calls
INNER_TRACKED = ("outer_model_inner_tracked", "compiled_forward_fn_inner_tracked")


@dataclass
class CompiledRun:
    losses: list[float]
    params: list[bytes]
    dynamo_counters: dict[str, dict[str, int]]  # compiles, graph breaks (by reason), graphs, ...
    unique_graphs: int
    reports: list[dict[str, Any]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    errors: int = 0


def _build(variant: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(what the user calls, the FSDP root, optimizer) for one compile variant."""
    from torch.distributed.fsdp import fully_shard

    blocks, whole, fullgraph, backend = VARIANTS[variant]
    torch.manual_seed(0)
    model = BlockModel(BLOCKS, WIDTH)
    for i, block in enumerate(model.layers):
        if blocks == "inplace":
            block.compile(backend=backend, fullgraph=fullgraph)
        elif blocks == "wrapper":
            model.layers[i] = torch.compile(block, backend=backend, fullgraph=fullgraph)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    top: nn.Module = model
    if whole == "wrapper":
        top = torch.compile(model, backend=backend)  # type: ignore[assignment]
    elif whole == "inplace":
        model.compile(backend=backend)
    elif whole == "function":  # a compiled function that calls the model, as a compiled training step does
        top = torch.compile(lambda x: model(x), backend=backend)  # type: ignore[assignment]
    return top, model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _train(variant: str, tracked: bool, deep_when_compiled: str = "skip", mode: str = "light",
           deep_every: int = 2) -> CompiledRun:
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from fsdp_mem_otel.config import TrackerConfig

    torch._dynamo.reset()
    counters.clear()
    # every run compiles from scratch: with caches on, the second run of a process (or any run
    # on a warm disk cache) hits what an earlier one saved, and dynamo's counters differ by that
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    rank = torch.distributed.get_rank()
    top, model, opt = _build(variant)
    tracker = None
    if tracked:
        config = TrackerConfig(mode=mode, deep_every=deep_every, deep_when_compiled=deep_when_compiled)
        tracker = FSDPMemoryTracker(model if variant in INNER_TRACKED else top, opt, config=config).attach()
    losses, reports = [], []
    for step in range(STEPS):
        losses.append(train_step(top, opt, make_batch(step, BATCH, WIDTH, rank)))
        if tracker is not None:
            reports.append(tracker.step().to_dict())
    if tracker is not None:
        tracker.detach()
    return CompiledRun(
        losses=losses,
        params=[p.detach().to_local().clone().numpy().tobytes() for p in model.parameters()],  # type: ignore[operator]
        dynamo_counters=_comparable(counters),
        unique_graphs=counters["stats"]["unique_graphs"],
        reports=reports,
        keys=tracker.module_keys if tracker else [],
        errors=tracker.errors_total if tracker else 0,
    )


def _comparable(counters: Any) -> dict[str, dict[str, int]]:
    """Dynamo's counters, comparable between two runs. "frames" counts every code object dynamo
    was shown, also those it skips untouched (the tracker's hooks are on its skip list); graph
    breaks are counted, not named (under whole-model compile the break before an FSDP module's
    hooks names the first hook dynamo meets, the tracker's instead of FSDP's)."""
    out = {k: dict(v) for k, v in counters.items() if k not in ("frames", "graph_break", "unimplemented")}
    out["breaks"] = {k: sum(counters[k].values()) for k in ("graph_break", "unimplemented")}
    return out


def compiled_pair(variant: str, skip_list: bool = True) -> tuple[CompiledRun, CompiledRun]:
    """Rank body: the untracked and the tracked (light, deep_every=2) compiled run.

    ``skip_list=False``: as on a torch whose dynamo skip list cannot be extended, the tracker's
    hooks are wrapped in torch.compiler.disable instead.
    """
    if not skip_list:
        from fsdp_mem_otel.training import compile_support

        compile_support._skipped = False
    return _train(variant, tracked=False), _train(variant, tracked=True)


def eager_deep_steps() -> CompiledRun:
    """Rank body: deep_when_compiled='eager' on fullgraph-compiled blocks."""
    return _train("block_inplace_fullgraph", tracked=True, deep_when_compiled="eager")


def outer_compiled_deep(variant: str) -> tuple[CompiledRun, CompiledRun, CompiledRun]:
    """Rank body: the untracked run and the tracked ones in deep mode and with deep_every=2, the
    tracker given the inner model while a compiled caller runs it."""
    return (_train(variant, tracked=False), _train(variant, tracked=True, mode="deep", deep_every=0),
            _train(variant, tracked=True))


@pytest.mark.parametrize("variant", INNER_TRACKED)
def test_deep_steps_leave_a_compiled_caller_unchanged(variant: str) -> None:
    for untracked, deep, deep_every_2 in run_ranks(outer_compiled_deep, variant, timeout=600):
        assert untracked.unique_graphs > 0
        for tracked, due in ((deep, [True] * STEPS), (deep_every_2, [False, True] * 2)):
            assert tracked.errors == 0
            assert tracked.losses == untracked.losses  # bitwise: the compiled caller stayed compiled
            assert tracked.params == untracked.params
            assert tracked.dynamo_counters == untracked.dynamo_counters
            # every step due to run deep stayed light, and says why
            assert [r["mode"] for r in tracked.reports] == ["light"] * STEPS
            assert [r["deep_skipped"] for r in tracked.reports] == [DEEP_SKIPPED_COMPILED if d else None for d in due]
            assert all(r["modules"]["<root>"]["snapshots"]["peak_forward"] for r in tracked.reports)


@pytest.mark.parametrize(
    ("variant", "skip_list"),
    [(v, True) for v in VARIANTS if v not in INNER_TRACKED] + [("block_inplace_fullgraph", False)],
)
def test_light_and_deep_every_leave_compiled_training_unchanged(variant: str, skip_list: bool) -> None:
    for untracked, tracked in run_ranks(compiled_pair, variant, skip_list, timeout=600):
        assert tracked.errors == 0
        assert tracked.losses == untracked.losses
        assert tracked.params == untracked.params
        # no graph break, (re)compile or graph added by the tracker's hooks: dynamo counts alike
        assert tracked.dynamo_counters == untracked.dynamo_counters
        assert untracked.unique_graphs > 0  # compiled code did run
        assert tracked.keys == ["<root>", "layers.0", "layers.1"]  # _orig_mod is no module key
        for report in tracked.reports:
            for key in tracked.keys:
                assert set(BOUNDARY_STATES) <= set(report["modules"][key]["snapshots"]), (key, report["step"])
                forward_end = report["modules"][key]["snapshots"]["after_post_forward"][0]["cpu"]
                assert forward_end["activation"] > 0, key  # saved tensors of compiled code seen
        # deep steps (2 and 4) would run compiled code eagerly: they stay light and say why
        assert [r["mode"] for r in tracked.reports] == ["light"] * STEPS
        assert [r["deep_skipped"] for r in tracked.reports] == [None, DEEP_SKIPPED_COMPILED] * 2


def test_eager_deep_steps_on_request() -> None:
    for run in run_ranks(eager_deep_steps, timeout=600):
        assert run.errors == 0
        assert [r["mode"] for r in run.reports] == ["light", "deep"] * 2
        assert all(r["deep_skipped"] is None for r in run.reports)
        for report in run.reports[1::2]:  # deep steps see every op, here eagerly
            assert report["peak"]["cpu"]["activation"] > 0
