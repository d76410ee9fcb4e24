"""A small decoder trained with FSDP2 (`fully_shard`) and a hand-written loop.

Run on CPU with 2 ranks:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 plain_fsdp2.py --out losses.json

Every rank writes losses.rank{RANK}.json with the loss of each optimizer step, the bytes of
its local parameter shards and the number of optimizer steps.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

VOCAB, DIM, HEADS, LAYERS = 256, 64, 4, 3
MICRO_BATCH, SEQ = 4, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp_norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, DIM))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def rank_file(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="JSON file to write (one per rank: .rank{RANK} is inserted)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    data = torch.Generator().manual_seed(1234 + rank)  # each rank reads its own batches
    losses = []
    for step in range(args.steps):
        step_loss = 0.0
        for _ in range(args.grad_accum):
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=data)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / args.grad_accum
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        if rank == 0:
            print(f"step {step + 1}: loss {step_loss:.6f}", flush=True)

    # FSDP2 parameters are DTensors: to_local() is this rank's shard
    local_shards = [p.to_local() for p in model.parameters()]
    result = {
        "losses": losses,
        "sharded_param_bytes": sum(t.numel() * t.element_size() for t in local_shards),
        "optimizer_steps": len(losses),
    }
    if args.out:
        with open(rank_file(args.out, rank), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
