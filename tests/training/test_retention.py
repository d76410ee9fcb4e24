"""Retention: whatever the tracker hooks must not outlive the step (no strong reference to a
tensor the training made), over a matrix of FSDP1/FSDP2 trainings on 2 real ranks.

The oracle is independent of the tracker: a global forward pre-hook and forward hook
(``StorageSpy``) keep a ``weakref.ref`` to the storage of every tensor in every module's inputs and
outputs, per step (a DTensor is looked through to its local tensor). After step s+1 has completed
(optimizer stepped, ``tracker.step()`` called) and ``gc.collect()``, the storages of step s still
alive are counted. The same training without the tracker (same seed, model, loop) gives the
expected counts: the tracked counts must equal them (both are 0 in every config so far). Each
step's batch is made inside a function and dropped, so the loop's own variables hold nothing.
"""

from __future__ import annotations

import gc
import traceback
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from fsdp_mem_otel.tools.demo import Block, BlockModel, WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH

STEPS = 4  # the storages of steps 0 .. STEPS-2 are counted, each after the step that follows it

# name -> (FSDP generation, WrapOptions fields, how to train). Training options: mode, deep_every,
# micro_batches, closure (optimizer.step(closure)), mixed_precision, compile ("before"/"after"
# fully_shard, in place, aot_eager), grouped ([fc1, fc2] per block), chunked_loss (norm+head
# sharded together, called outside the root's forward on leaf chunks), hsdp (a 2-D mesh shape).
CONFIGS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "fsdp1_light": (1, {}, {}),
    "fsdp1_deep": (1, {}, {"mode": "deep"}),
    "fsdp1_deep_every_2": (1, {}, {"deep_every": 2}),
    "fsdp1_checkpoint_wrapper": (1, {"checkpoint": True}, {}),
    "fsdp1_inner_checkpoint": (1, {"inner_checkpoint": True}, {}),
    "fsdp1_inner_checkpoint_deep": (1, {"inner_checkpoint": True}, {"mode": "deep"}),
    "fsdp1_flat_params": (1, {"use_orig_params": False}, {}),
    "fsdp1_mixed_precision": (1, {}, {"mixed_precision": True}),
    "fsdp1_grad_accumulation": (1, {}, {"micro_batches": 2}),
    "fsdp1_closure": (1, {}, {"closure": True}),
    "fsdp2_light": (2, {}, {}),
    "fsdp2_deep": (2, {}, {"mode": "deep"}),
    "fsdp2_deep_every_2": (2, {}, {"deep_every": 2}),
    "fsdp2_checkpoint_wrapper": (2, {"checkpoint": True}, {}),
    "fsdp2_inner_checkpoint": (2, {"inner_checkpoint": True}, {}),
    "fsdp2_nested_inner_checkpoint_deep": (2, {"nested": True, "inner_checkpoint": True}, {"mode": "deep"}),
    "fsdp2_compile_before_shard": (2, {}, {"compile": "before", "deep_every": 2}),
    "fsdp2_compile_after_shard": (2, {}, {"compile": "after"}),
    "fsdp2_grouped": (2, {}, {"grouped": True}),
    "fsdp2_grouped_deep": (2, {}, {"grouped": True, "mode": "deep"}),
    "fsdp2_chunked_loss": (2, {}, {"chunked_loss": True}),
    "fsdp2_hsdp_2x1": (2, {}, {"hsdp": (2, 1)}),
    "fsdp2_hsdp_1x2": (2, {}, {"hsdp": (1, 2)}),
    "fsdp2_mixed_precision": (2, {}, {"mixed_precision": True}),
    "fsdp2_mixed_precision_deep": (2, {}, {"mixed_precision": True, "mode": "deep"}),
    "fsdp2_grad_accumulation": (2, {}, {"micro_batches": 2}),
    "fsdp2_closure": (2, {}, {"closure": True}),
}


class StorageSpy:
    """Weak references to the storages of every module's inputs and outputs, one list per step."""

    def __init__(self) -> None:
        self.seen: list[list[weakref.ref[torch.UntypedStorage]]] = [[]]
        self.counts: list[int] = []  # step s's storages alive once step s+1 has ended, s = 0, 1, ...
        self._by_id: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> StorageSpy:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        # compiler.disable: inside a compiled block the hooks see real tensors (a graph break, the
        # same in the tracked and the untracked run)
        pre = torch.compiler.disable(lambda _mod, args: self._see(args))
        post = torch.compiler.disable(lambda _mod, args, kwargs, out: self._see((args, kwargs, out)))
        self._handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, with_kwargs=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _see(self, obj: Any) -> None:
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor):
                st = getattr(t, "_local_tensor", t).untyped_storage()
                ref = self._by_id.get(id(st))
                if ref is None or ref() is not st:  # new, or an earlier storage's id reused
                    ref = self._by_id[id(st)] = weakref.ref(st)
                    self.seen[-1].append(ref)

    def end_step(self) -> None:
        """The current step has ended: count the step before it (after gc), start the next one."""
        if len(self.seen) > 1:
            gc.collect()
            self.counts.append(self.alive(len(self.seen) - 2))
        self.seen.append([])
        self._by_id = {}

    def alive(self, step: int) -> int:
        return sum(ref() is not None for ref in self.seen[step])


class ChunkedLossModel(nn.Module):
    """Blocks, then norm + head: forward runs the blocks only; the loss applies norm and head
    chunk by chunk outside it (torchtitan's chunked loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(WIDTH) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _build(fsdp: int, wrap: dict[str, Any], train: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    own = ("mixed_precision", "compile", "grouped", "chunked_loss", "hsdp")
    if not any(k in train for k in own):
        return build(BLOCKS, WIDTH, WrapOptions(fsdp=fsdp, **wrap))
    torch.manual_seed(0)
    model: nn.Module
    if fsdp == 1:  # only mixed precision here
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(BlockModel(BLOCKS, WIDTH), auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         use_orig_params=True, device_id=torch.device("cpu"),
                                         mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if train.get("mixed_precision"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if "hsdp" in train:
        kw["mesh"] = init_device_mesh("cpu", train["hsdp"], mesh_dim_names=("replicate", "shard"))
    model = ChunkedLossModel() if train.get("chunked_loss") else BlockModel(BLOCKS, WIDTH)
    blocks: list[Any] = list(model.layers)
    for block in blocks:
        if train.get("compile") == "before":
            block.compile(backend="aot_eager")
        fully_shard([block.fc1, block.fc2] if train.get("grouped") else block, **kw)
        if train.get("compile") == "after":
            block.compile(backend="aot_eager")
    if train.get("chunked_loss"):
        fully_shard([model.norm, model.head], **kw)  # type: ignore[list-item]
    fully_shard(model, **kw)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _chunked_loss_step(model: Any, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """The body's output cut into 4 leaf chunks, each through norm+head and backward on its own,
    then the chunks' gradients back through the body."""
    opt.zero_grad(set_to_none=True)
    hidden = model(x)
    grads = []
    for chunk in hidden.detach().chunk(4):
        leaf = chunk.detach().requires_grad_(True)
        model.head(model.norm(leaf)).pow(2).mean().backward()
        grads.append(leaf.grad)
    hidden.backward(torch.cat(grads))
    opt.step()


def _one_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, train: dict[str, Any],
              tracker: FSDPMemoryTracker | None) -> None:
    """One optimizer step; its batch lives only here."""
    x = make_batch(step, BATCH, WIDTH, torch.distributed.get_rank())
    on_inputs = tracker.track_inputs if tracker is not None else None
    if train.get("chunked_loss"):
        if on_inputs is not None:
            on_inputs(x)
        _chunked_loss_step(model, opt, x)
    elif train.get("closure"):
        if on_inputs is not None:
            on_inputs(x)

        def closure() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)  # type: ignore[arg-type]
    else:
        train_step(model, opt, x, micro_batches=train.get("micro_batches", 1), on_inputs=on_inputs)


def _train(fsdp: int, wrap: dict[str, Any], train: dict[str, Any], tracked: bool) -> dict[str, Any]:
    """Alive storages of each step after the next one, and how many each step saw."""
    if "compile" in train:  # both runs compile from scratch (as tests/training/test_compile.py does)
        import torch._dynamo
        import torch._functorch.config
        import torch._inductor.config

        torch._dynamo.reset()
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    model, opt = _build(fsdp, wrap, train)
    tracker = None
    if tracked:
        tracker = FSDPMemoryTracker(model, opt, mode=train.get("mode", "light"), deep_every=train.get("deep_every", 0))
    with StorageSpy() as spy:
        if tracker is not None:
            tracker.attach()
        for step in range(STEPS):
            _one_step(model, opt, step, train, tracker)
            if tracker is not None:
                tracker.step()
            spy.end_step()
        if tracker is not None:
            tracker.detach()
    return {"alive": spy.counts, "seen": [len(s) for s in spy.seen[:-1]],
            "errors": tracker.errors_total if tracker is not None else 0}


def retention(names: list[str]) -> list[dict[str, Any]]:
    """Rank body: per config, the untracked and the tracked run (or the traceback it raised)."""
    out: list[dict[str, Any]] = []
    for name in names:
        fsdp, wrap, train = CONFIGS[name]
        try:
            out.append({"untracked": _train(fsdp, wrap, train, False), "tracked": _train(fsdp, wrap, train, True)})
        except Exception:  # noqa: BLE001 - one failing config must not hide the others
            out.append({"raised": traceback.format_exc()})
    return out


def _run(fsdp: int) -> dict[str, list[dict[str, Any]]]:
    """Config name -> per-rank results, for one spawn of every config of generation ``fsdp``."""
    names = [n for n, (gen, _, _) in CONFIGS.items() if gen == fsdp]
    per_rank = run_ranks(retention, names, timeout=600)
    return {name: [per_rank[r][i] for r in range(len(per_rank))] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def fsdp1_retention() -> dict[str, list[dict[str, Any]]]:
    return _run(1)


@pytest.fixture(scope="module")
def fsdp2_retention() -> dict[str, list[dict[str, Any]]]:
    return _run(2)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_step_outlives_the_next(name: str, rank: int, request: pytest.FixtureRequest) -> None:
    res = request.getfixturevalue(f"fsdp{CONFIGS[name][0]}_retention")[name][rank]
    assert "raised" not in res, res.get("raised")
    tracked, untracked = res["tracked"], res["untracked"]
    assert tracked["errors"] == 0
    assert all(n > 0 for n in untracked["seen"])  # the spy did see the modules' tensors
    # step s's storages alive after step s+1: as many as without the tracker (0 where that is 0)
    assert tracked["alive"] == untracked["alive"], (tracked, untracked)
