"""A small FSDP training used by the demo, the tests and the benchmarks.

``BlockModel`` is a stack of residual blocks (LayerNorm + two Linear); with a small width it is
dispatch-bound (per-op overhead dominates, as on a GPU), with a large width compute-bound.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn


class InnerLinear(nn.Linear):
    """A Linear that nested wrapping shards on its own (a distinct type for FSDP1 policies)."""


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))); ``inner_checkpoint`` recomputes fc1+gelu in backward."""

    def __init__(self, width: int, inner_checkpoint: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = InnerLinear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.inner_checkpoint = inner_checkpoint

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.inner_checkpoint:
            h = torch.utils.checkpoint.checkpoint(self._hidden, h, use_reentrant=False)
        else:
            h = self._hidden(h)
        return x + self.fc2(h)


class BlockModel(nn.Module):
    """``blocks`` Blocks of ``width`` features, then a Linear head.

    ``repeat_first`` calls the first block twice per forward (a module used several times).
    """

    def __init__(self, blocks: int, width: int, inner_checkpoint: bool = False, repeat_first: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width, inner_checkpoint) for _ in range(blocks))
        self.head = nn.Linear(width, width)
        self.repeat_first = repeat_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.repeat_first:
            x = self.layers[0](x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@dataclass
class WrapOptions:
    """How to wrap a BlockModel with FSDP."""

    fsdp: int = 2
    reshard_after_forward: bool = True
    use_orig_params: bool = True
    checkpoint: bool = False  # checkpoint_wrapper around each block
    inner_checkpoint: bool = False  # torch.utils.checkpoint inside each block
    nested: bool = False  # also shard each block's fc1 on its own
    repeat_first: bool = False  # call the first block twice per forward


def wrap(model: BlockModel, opts: WrapOptions) -> nn.Module:
    """Shard each block and the root with FSDP ``opts.fsdp`` (1 or 2)."""
    if opts.checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    if opts.fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        if opts.nested:
            for m in model.modules():
                if isinstance(m, InnerLinear):
                    fully_shard(m, reshard_after_forward=opts.reshard_after_forward)
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=opts.reshard_after_forward)
        fully_shard(model, reshard_after_forward=opts.reshard_after_forward)
        return model
    if opts.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = ShardingStrategy.FULL_SHARD if opts.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block, InnerLinear} if opts.nested else {Block}),
            use_orig_params=opts.use_orig_params,
            sharding_strategy=strategy,
            device_id=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"),
        )
    raise ValueError(f"fsdp must be 1 or 2; got {opts.fsdp!r}")


def build(blocks: int, width: int, opts: WrapOptions, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A wrapped BlockModel (same initial weights on every rank) and its Adam optimizer."""
    torch.manual_seed(seed)
    model = wrap(BlockModel(blocks, width, opts.inner_checkpoint, opts.repeat_first), opts)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def make_batch(step: int, batch: int, width: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, width, generator=g)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    micro_batches: int = 1,
    on_inputs: Callable[[torch.Tensor], None] | None = None,
) -> float:
    """zero_grad, ``micro_batches`` forward/backward passes, optimizer step; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for chunk in x.chunk(micro_batches):
        if on_inputs is not None:
            on_inputs(chunk)
        loss = model(chunk).pow(2).mean()
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return total


def init_distributed() -> tuple[int, int]:
    """Join the torchrun / spawned process group on gloo; returns (rank, world_size)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return dist.get_rank(), dist.get_world_size()
