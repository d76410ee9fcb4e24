"""Small models whose memory depends on the batch's content while every input shape stays the
same (tests/training/test_content_dependent.py trains them under FSDP2 and FSDP1).

Every batch is ROWS x WIDTH. The step's decision (``FLAGS[step]``) is written into the batch's
first row, the same on every rank (FSDP's collectives need the same wrapped modules to run on
each rank); the rest of the batch differs per rank. The root reads the decision from the data and
hands it to the middle block; MoE blocks route their own input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

WIDTH, ROWS, EXPERTS, BLOCKS = 32, 8, 4, 3
#: each step's decision: runs of one, then the other (steps that repeat the ones before, then one that does not)
FLAGS = (0, 0, 0, 1, 0, 0, 1, 1, 0, 1)
STEPS = len(FLAGS)


class Body(nn.Module):
    """x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Steady(Body):
    """The control: the same work whatever the flag."""

    def forward(self, x: torch.Tensor, flag: bool = False) -> torch.Tensor:
        return super().forward(x)


class Adaptive(Body):
    """Adaptive depth, shared weights: the body runs twice on flagged batches."""

    def forward(self, x: torch.Tensor, flag: bool = False) -> torch.Tensor:
        x = super().forward(x)
        return super().forward(x) if flag else x


class Conditional(Body):
    """A sub-layer with parameters of its own, used on flagged batches only (its gradient and
    optimizer state appear at the first of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, flag: bool = False) -> torch.Tensor:
        x = super().forward(x)
        return x + self.extra(x).relu() if flag else x


class PassThrough(Body):
    """Returns its input on flagged batches: no gradient for its parameters on those steps."""

    def forward(self, x: torch.Tensor, flag: bool = False) -> torch.Tensor:
        return x if flag else super().forward(x)


class MoE(nn.Module):
    """Top-1 mixture of experts. Each token goes to one expert: the one its gate scores highest,
    or with ``by_content``, the one its first EXPERTS features name (a router without parameters,
    as hash routing has, so that the batch decides the counts). With ``capacity``, an expert takes
    that many tokens at most and drops the rest (they keep the residual only). Every expert runs
    every step, on the tokens routed to it (maybe none)."""

    def __init__(self, by_content: bool = False, capacity: int | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.gate = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(EXPERTS))
        self.by_content, self.capacity = by_content, capacity

    def forward(self, x: torch.Tensor, flag: bool = False) -> torch.Tensor:
        h = self.norm(x)
        probs = self.gate(h).softmax(-1)
        choice = (x[:, :EXPERTS] if self.by_content else probs).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)[:self.capacity]
            out = out.index_add(0, rows, expert(h[rows]) * probs[rows, e:e + 1])
        return x + out


class Model(nn.Module):
    """BLOCKS blocks, then a Linear head. The decision is read from the batch (its first row's
    last feature): flagged batches switch the middle block, or with ``layer_drop``, skip it
    altogether (LayerDrop decided at the root)."""

    def __init__(self, make_block: Any, layer_drop: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(make_block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, WIDTH)
        self.layer_drop = layer_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flag = bool(x[0, -1] > 0)
        for i, layer in enumerate(self.layers):
            if i != 1 or not (flag and self.layer_drop):
                x = layer(x, flag=flag and i == 1)
        return self.head(x)


#: name -> (block, layer_drop, routed: the batch decides each token's expert, spread evenly or, on
#: flagged steps, all to expert 0). Top-1 over experts of one size: without capacity the experts
#: hold the same bytes in all however the tokens spread; capacity drops what a full expert gets,
#: so the learnt gate's routing (other on every step and rank) changes what the step holds.
SCENARIOS: dict[str, tuple[Any, bool, bool]] = {
    "steady": (Steady, False, False),
    "adaptive_depth": (Adaptive, False, False),
    "conditional_sublayer": (Conditional, False, False),
    "moe_counts": (lambda: MoE(by_content=True), False, True),
    "moe_counts_capacity": (lambda: MoE(by_content=True, capacity=ROWS // EXPERTS), False, True),
    "moe_gate_routing": (lambda: MoE(capacity=ROWS // EXPERTS), False, False),
    "layer_drop": (Steady, True, False),
    "pass_through": (PassThrough, False, False),
}
BLOCK_TYPES = (Steady, Adaptive, Conditional, PassThrough, MoE)


def build_model(name: str) -> nn.Module:
    """The scenario's model, unwrapped, with the same weights on every rank."""
    make_block, layer_drop, _ = SCENARIOS[name]
    torch.manual_seed(0)
    return Model(make_block, layer_drop)


def make_batch(name: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's input and target: ROWS x WIDTH each, whatever the step decides."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, target = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    flag = FLAGS[step]
    if SCENARIOS[name][2]:  # a large feature names each token's expert (the residual keeps it)
        experts = torch.zeros(ROWS, dtype=torch.long) if flag else torch.arange(ROWS) % EXPERTS
        x[torch.arange(ROWS), experts] += 10
    x[0, -1] = (x[0, -1].abs() + 0.1) * (1 if flag else -1)
    return x, target
