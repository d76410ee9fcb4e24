"""Leak reports on real 2-rank FSDP1 and FSDP2 runs.

Oracles: the bytes of the storages autograd saves in a step, recorded by saved-tensor hooks of the
test's own (the tracker chains to them) and alive at the step's end; numel x element size of the
inputs a loop keeps; and loops without the bug, which must report nothing for 100 steps (over
three times the detector's 30-step window).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.tools.demo import BlockModel, WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import settle

BLOCKS, WIDTH, BATCH = 2, 16, 4


@dataclass
class LeakRun:
    leaks: list[dict[str, Any] | None]  # StepReport.leak per step
    retained_per_step: list[int]  # bytes of the storages saved in each step, alive at its end
    errors: int


def kept_losses(fsdp: int, steps: int = 14) -> LeakRun:
    """Rank body: the demo's --leak loop (each loss kept with its graph), light mode."""
    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=fsdp))
    tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig()).attach()
    kept: list[torch.Tensor] = []
    leaks, retained = [], []
    for step in range(steps):
        settle()
        saved: dict[int, weakref.ref[torch.UntypedStorage]] = {}

        def pack(t: torch.Tensor, saved: dict[int, Any] = saved) -> torch.Tensor:
            st = t.untyped_storage()
            saved.setdefault(id(st), weakref.ref(st))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            train_step(model, opt, make_batch(step, BATCH, WIDTH, rank), on_inputs=tracker.track_inputs,
                       keep_losses=kept)
        report = tracker.step()
        leaks.append(None if report.leak is None else report.leak.to_dict())
        # alive, at their size now (FSDP resizes the unsharded parameters autograd saved to 0)
        retained.append(sum(st.nbytes() for ref in saved.values() if (st := ref()) is not None))
    tracker.detach()
    return LeakRun(leaks, retained, tracker.errors_total)


class _ChunkedModel(nn.Module):
    """Blocks, then norm + head, applied outside the forward on detached chunks (a chunked loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = BlockModel(BLOCKS, WIDTH)
        self.tail = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))  # norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def kept_chunks(fsdp: int, steps: int = 14) -> LeakRun:
    """Rank body: a chunked loss whose loop keeps every chunk it fed to the head."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = _ChunkedModel()
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.body)
        fully_shard([model.tail[0], model.tail[1]])  # norm and head in one group, as torchtitan does
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model.body = FSDP(model.body, device_id=torch.device("cpu"), use_orig_params=True)  # type: ignore[assignment]
        model.tail = FSDP(model.tail, device_id=torch.device("cpu"), use_orig_params=True)  # type: ignore[assignment]
        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)  # type: ignore[assignment]
    inner: Any = model if fsdp == 2 else model.module
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tracker = FSDPMemoryTracker(model, opt).attach()
    kept: list[torch.Tensor] = []
    leaks, retained = [], []
    for step in range(steps):
        settle()
        opt.zero_grad(set_to_none=True)
        hidden = model(make_batch(step, BATCH, WIDTH, rank))
        grads = []
        for chunk in hidden.detach().split(BATCH // 2):
            chunk = chunk.clone().requires_grad_(True)  # a copy each, as torchtitan's split along the sequence
            kept.append(chunk)  # the bug: every chunk of every step stays referenced
            inner.tail(chunk).pow(2).mean().backward()
            grads.append(chunk.grad)
        hidden.backward(torch.cat(grads))
        opt.step()
        report = tracker.step()
        leaks.append(None if report.leak is None else report.leak.to_dict())
        retained.append(BATCH * WIDTH * 4)  # the chunks of one step: the whole hidden state
    tracker.detach()
    return LeakRun(leaks, retained, tracker.errors_total)


HEALTHY_STEPS = 100  # steps of the loops without the bug


def healthy(fsdp: int, mode: str, wrap: dict[str, Any], micro_batches: int, steps: int = HEALTHY_STEPS) -> LeakRun:
    """Rank body: the same loop without the bug, for ``steps`` steps."""
    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=fsdp, **wrap))
    tracker = FSDPMemoryTracker(model, opt, mode=mode).attach()
    leaks = []
    for step in range(steps):
        train_step(model, opt, make_batch(step % 7, BATCH, WIDTH, rank), micro_batches=micro_batches,
                   on_inputs=tracker.track_inputs)
        report = tracker.step()
        leaks.append(None if report.leak is None else report.leak.to_dict())
    tracker.detach()
    return LeakRun(leaks, [], tracker.errors_total)


HEALTHY = {
    "light": ("light", {}, 1),
    "deep": ("deep", {}, 1),
    "checkpointing": ("light", {"checkpoint": True}, 1),
    "accumulation": ("light", {}, 2),
}


def healthy_all(fsdp: int) -> list[LeakRun]:
    return [healthy(fsdp, *cfg) for cfg in HEALTHY.values()]


@pytest.mark.parametrize("fsdp", [1, 2])
def test_a_kept_loss_is_a_leak_named_by_module(fsdp: int) -> None:
    for run in run_ranks(kept_losses, fsdp):
        assert run.errors == 0
        assert all(leak is None or not leak["growing"] for leak in run.leaks[:9])  # judged from step 10
        leak = run.leaks[-1]
        assert leak is not None
        # what the test's own hooks saw saved in a step and alive at its end, every step alike
        per_step = run.retained_per_step[-1]
        assert per_step > 0 and set(run.retained_per_step[2:]) == {per_step}
        assert leak["growing"]["total"] == pytest.approx(per_step, rel=1e-6)
        assert leak["growing"]["activation"] > 0.5 * per_step
        blocks = {"layers.0", "layers.1"}
        assert blocks <= set(leak["held"])  # the modules whose saved tensors stay alive


@pytest.mark.parametrize("fsdp", [1, 2])
def test_kept_chunks_are_a_leak_of_the_head(fsdp: int) -> None:
    for run in run_ranks(kept_chunks, fsdp):
        assert run.errors == 0
        leak = run.leaks[-1]
        assert leak is not None and leak["growing"]["total"] == pytest.approx(run.retained_per_step[-1], rel=1e-6)
        holder = "tail.0" if fsdp == 2 else "tail"  # the FSDP module the chunks enter (the norm)
        assert next(iter(leak["held"])) == holder


@pytest.mark.parametrize("fsdp", [1, 2])
def test_loops_without_the_bug_report_nothing_for_100_steps(fsdp: int) -> None:
    for runs in run_ranks(healthy_all, fsdp, timeout=900):
        for name, run in zip(HEALTHY, runs, strict=True):
            assert run.errors == 0, name
            assert run.leaks == [None] * HEALTHY_STEPS, (name, next(x for x in run.leaks if x is not None))
