"""Models and wrappers that ``fsdp-mem-otel estimate`` loads by ``module:function`` in the tests,
and that the real 2-rank runs build the same way (spawned ranks import this module by path)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ = 256, 64, 4, 3, 32


class Attention(nn.Module):
    """Causal self-attention through scaled_dot_product_attention, as Llama-style models do."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Layer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)) with a SiLU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))


class Transformer(nn.Module):
    """Token embedding, LAYERS decoder layers, final norm and an untied output head."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def transformer() -> nn.Module:
    """The model factory: ``tests.estimate_models:transformer``."""
    return Transformer()


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token."""
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def fsdp1_wrap(model: nn.Module, **_: Any) -> nn.Module:
    """A wrap that applies FSDP1 (on CPU, as the demo does), which estimate does not support."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"))


def no_wrap(model: nn.Module, **_: Any) -> nn.Module:
    """A wrap that forgets to shard."""
    return model
