"""A small MLP trained with Lightning's `ModelParallelStrategy` (FSDP2: `fully_shard` in
`configure_model`), on CPU.

Run on CPU with 2 ranks:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 lightning_fsdp2.py --out losses.json

Every rank writes losses.rank{RANK}.json with the loss of each optimizer step (the mean of its
micro-batches' losses on this rank: Lightning gives each rank its own part of the data), the
bytes of its local parameter shards and the number of optimizer steps.
"""

import argparse
import json
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

WIDTH, BLOCKS, MICRO_BATCH = 64, 3, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # same initial weights on every rank
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)
        self.micro_batch_losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # outputs["loss"] is training_step's loss, divided by accumulate_grad_batches
        self.micro_batch_losses.append(outputs["loss"].item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def rank_file(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="JSON file to write (one per rank: .rank{RANK} is inserted)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    args = parser.parse_args()

    data = torch.Generator().manual_seed(1)
    x = torch.randn(256, WIDTH, generator=data)
    y = x.sum(dim=1, keepdim=True).sin()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=MICRO_BATCH)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        # by default every device goes to tensor parallelism: shard over both ranks instead
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        accumulate_grad_batches=args.grad_accum,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor()
    trainer.fit(model, loader)

    # one optimizer step's loss: the sum of its micro-batches' (already divided) losses
    losses = []
    for i in range(0, len(model.micro_batch_losses), args.grad_accum):
        step_loss = 0.0
        for micro_batch_loss in model.micro_batch_losses[i:i + args.grad_accum]:
            step_loss += micro_batch_loss
        losses.append(step_loss)
    local_shards = [p.to_local() for p in model.parameters()]
    result = {
        "losses": losses,
        "sharded_param_bytes": sum(t.numel() * t.element_size() for t in local_shards),
        "optimizer_steps": trainer.global_step,
    }
    if args.out:
        with open(rank_file(args.out, trainer.global_rank), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
