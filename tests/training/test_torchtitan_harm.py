"""No harm to a torchtitan-style training, with torchtitan's own classes, on real ranks (gloo):

- a chunked loss (torchtitan's ``ChunkedLossWrapper``, and the same by hand in plain torch) over a
  model whose final ``norm`` and ``lm_head`` share one ``fully_shard([norm, lm_head])`` group, as
  torchtitan shards its last layers: every chunk entering that group must be freed once its step
  is over, with the tracker attached (light and deep) as without it, and the losses must be
  bitwise those of the untracked run;
- torchtitan's ``OptimizersContainer`` passed to the tracker as the optimizer: the optimizer
  state it reports is that of the optimizers the container holds.

Adaptations for CPU / gloo, none of them to torchtitan's code: the optimizers use
``implementation="for-loop"`` (``"fused"``, the default, is CUDA-only); the loss runs under
torchtitan's default ``spmd_types`` backend with no SPMD mesh registered and type checking off
(what ``get_spmd_backend()`` / ``spmd.is_type_checking()`` give outside torchtitan's trainer), so
its tensor-parallel branches are not taken; FSDP reduces fp32 gradients with ``ReduceOp.AVG``,
which gloo has, so ``set_force_sum_reduction_for_comms`` is not needed.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fsdp_mem_otel.training.tracker import FSDPMemoryTracker  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.oracles import optimizer_state_bytes, sharded_param_bytes  # noqa: E402

VOCAB, DIM, LAYERS = 128, 32, 2
BATCH, SEQ, CHUNKS = 2, 16, 4
STEPS = 3
MODES = ("untracked", "light", "deep")
LOSSES = ("torchtitan", "plain")


# -- a small decoder, sharded as torchtitan shards its decoders --------------------------------
class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Decoder(nn.Module):
    """Embedding, blocks, final norm, lm_head. As torchtitan's ``Decoder``, ``_skip_lm_head``
    (set for ``ChunkedLossWrapper``) returns the normed hidden states; ``_skip_norm`` returns
    them before the norm, for the plain-torch chunked loss that applies ``lm_head(norm(chunk))``."""

    _skip_lm_head = False
    _skip_norm = False

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        if self._skip_norm:
            return h
        h = self.norm(h)
        if self._skip_lm_head:
            return h
        return self.lm_head(h)


def sharded_decoder() -> Decoder:
    """Same initial weights on every rank; sharded as torchtitan's ``apply_fsdp`` does without
    weight tying: the embedding, each block, ``[norm, lm_head]`` in one group (not resharded after
    forward), then the root."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Decoder()
    fully_shard(model.tok_embeddings)
    fully_shard([model.norm, model.lm_head], reshard_after_forward=False)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + torch.distributed.get_rank())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# -- 1. chunked loss: no chunk outlives its step ------------------------------------------------
def titan_chunked_step(model: Decoder, loss_fn: Any, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's way: hidden states after the norm, ``ChunkedLossWrapper`` applies lm_head per
    chunk (backward per chunk) and its loss's backward runs the decoder's."""
    model._skip_lm_head = True
    hidden = model(tokens)
    loss, _ = loss_fn(hidden, labels, torch.tensor(float(labels.numel())))
    loss.backward()
    return loss.detach()


def plain_chunked_step(model: Decoder, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same by hand: detached leaf chunks through ``lm_head(norm(chunk))``, backward per chunk,
    then the decoder's backward with the gathered chunk gradients. ``.contiguous()`` as in
    torchtitan, so each chunk has storage of its own."""
    model._skip_norm = True
    hidden = model(tokens)
    n = labels.numel()
    total = torch.zeros(())
    grads = []
    for h, y in zip(hidden.detach().split(SEQ // CHUNKS, dim=1), labels.split(SEQ // CHUNKS, dim=1), strict=True):
        chunk = h.contiguous().detach().requires_grad_(True)
        logits = model.lm_head(model.norm(chunk))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / n
        loss.backward()
        assert chunk.grad is not None
        grads.append(chunk.grad)
        total += loss.detach()
    hidden.backward(torch.cat(grads, dim=1))
    return total


@dataclass
class ChunkedRun:
    losses: list[float]  # per step
    entered: dict[str, list[int]]  # "norm" / "lm_head" -> tensors captured entering it, per step
    alive: dict[str, list[int]]  # the same -> how many of step s-1's were alive after step s
    errors: int


def chunked_run(loss_kind: str, mode: str) -> ChunkedRun:
    from torchtitan.components.loss import ChunkedLossWrapper

    model = sharded_decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    loss_fn = ChunkedLossWrapper.Config(num_chunks=CHUNKS).build()
    loss_fn.set_lm_head(model.lm_head)

    captured: dict[str, list[weakref.ref[Any]]] = {"norm": [], "lm_head": []}

    def capture(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            captured[name].append(weakref.ref(args[0].untyped_storage()))

        return hook

    # On the group's two members, after fully_shard (FSDP's pre-forward runs first): what the
    # module computes with. torchtitan's chunks enter lm_head; the plain loss's leaf chunks enter
    # norm (lm_head then gets norm's output, a non-leaf).
    handles = [model.norm.register_forward_pre_hook(capture("norm")),
               model.lm_head.register_forward_pre_hook(capture("lm_head"))]
    tracker = None if mode == "untracked" else FSDPMemoryTracker(model, opt, mode=mode)
    res = ChunkedRun([], {k: [] for k in captured}, {k: [] for k in captured}, 0)
    previous: dict[str, list[weakref.ref[Any]]] = {}
    with tracker if tracker is not None else contextlib.nullcontext():
        for step in range(STEPS):
            tokens, labels = batch(step)
            if loss_kind == "torchtitan":
                loss = titan_chunked_step(model, loss_fn, tokens, labels)
            else:
                loss = plain_chunked_step(model, tokens, labels)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if tracker is not None:
                tracker.step()
            res.losses.append(loss.item())
            del loss
            gc.collect()
            for name, refs in previous.items():  # the step before this one's
                res.alive[name].append(sum(r() is not None for r in refs))
            for name in captured:
                res.entered[name].append(len(captured[name]))
            previous = {name: list(refs) for name, refs in captured.items()}
            for refs in captured.values():
                refs.clear()
    for h in handles:
        h.remove()
    res.errors = 0 if tracker is None else tracker.errors_total
    return res


# -- 2. torchtitan's OptimizersContainer --------------------------------------------------------
@dataclass
class ContainerRun:
    reported: list[int]  # the report's current cpu optimizer_state, per step
    inner: list[int]  # numel x element size of the inner optimizers' state tensors, per step
    container_state: list[int]  # the same of the container's own .state (empty)
    adam_arithmetic: list[int]  # 2 x sharded param bytes + one 4-byte step per parameter
    optimizers: int
    errors: int


def container_run() -> ContainerRun:
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    model = sharded_decoder()
    # as torchtitan's trainer builds it (config.optimizer.build(model_parts=...)); two optimizer
    # types, so the container holds two optimizers
    config = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=r"norm", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                             optimizer_kwargs={"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}),
        ],
        implementation="for-loop",  # "fused" (the default) is CUDA-only
    )
    container = config.build(model_parts=[model])
    n_params = sum(1 for _ in model.parameters())
    res = ContainerRun([], [], [], [], len(container.optimizers), 0)
    with FSDPMemoryTracker(model, container) as tracker:
        for step in range(STEPS):
            tokens, labels = batch(step)
            logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
            container.step()
            container.zero_grad()
            report = tracker.step()
            res.reported.append(report.current["cpu"]["optimizer_state"])
            res.inner.append(sum(optimizer_state_bytes(opt) for opt in container.optimizers))
            res.container_state.append(optimizer_state_bytes(container))
            res.adam_arithmetic.append(2 * sharded_param_bytes(model) + 4 * n_params)
    res.errors = tracker.errors_total
    return res


# -- one spawn for both ---------------------------------------------------------------------------
@dataclass
class RankResult:
    chunked: dict[tuple[str, str], ChunkedRun]  # (loss, mode) -> run
    container: ContainerRun


def titan_harm() -> RankResult:
    chunked = {(loss, mode): chunked_run(loss, mode) for loss in LOSSES for mode in MODES}
    return RankResult(chunked, container_run())


@pytest.fixture(scope="module")
def results() -> list[RankResult]:
    return run_ranks(titan_harm)


@pytest.mark.parametrize("loss", LOSSES)
def test_untracked_chunked_loss_frees_its_chunks(results: list[RankResult], loss: str) -> None:
    """The oracle itself: every chunk is seen entering the group, and none outlives its step."""
    for res in results:
        run = res.chunked[(loss, "untracked")]
        lm_head_calls = CHUNKS
        norm_calls = 1 if loss == "torchtitan" else CHUNKS  # torchtitan: norm in the model forward
        assert run.entered == {"norm": [norm_calls] * STEPS, "lm_head": [lm_head_calls] * STEPS}
        assert run.alive == {"norm": [0] * (STEPS - 1), "lm_head": [0] * (STEPS - 1)}


@pytest.mark.parametrize("mode", ["light", "deep"])
@pytest.mark.parametrize("loss", LOSSES)
def test_tracker_keeps_no_chunk_alive(results: list[RankResult], loss: str, mode: str) -> None:
    for res in results:
        run, untracked = res.chunked[(loss, mode)], res.chunked[(loss, "untracked")]
        assert run.errors == 0
        assert run.entered == untracked.entered
        assert run.alive == {"norm": [0] * (STEPS - 1), "lm_head": [0] * (STEPS - 1)}, run.alive


@pytest.mark.parametrize("mode", ["light", "deep"])
@pytest.mark.parametrize("loss", LOSSES)
def test_tracker_leaves_chunked_training_unchanged(results: list[RankResult], loss: str, mode: str) -> None:
    for res in results:
        untracked = res.chunked[(loss, "untracked")].losses
        assert len(set(untracked)) == STEPS  # it trains: a different loss every step
        assert res.chunked[(loss, mode)].losses == untracked  # bitwise


def test_optimizers_container_state_is_its_optimizers_state(results: list[RankResult]) -> None:
    for res in results:
        run = res.container
        assert run.errors == 0
        assert run.optimizers == 2
        assert run.container_state == [0] * STEPS  # the container's own .state stays empty
        assert run.inner == run.adam_arithmetic  # the oracle, against Adam's arithmetic
        assert run.reported == run.inner
