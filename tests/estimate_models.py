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


# -- torchtitan's Llama3 debug model, as tests/user_scripts/torchtitan_llama3.py trains it ---------------
# For ``fsdp-mem-otel estimate --model tests.estimate_models:torchtitan_llama3 --wrap
# tests.estimate_models:torchtitan_wrap --loss tests.estimate_models:torchtitan_loss --optimizer
# tests.estimate_models:torchtitan_optimizer --batch-shape 2,64 --input-dtype int64 --param-dtype bf16
# --reduce-dtype fp32``: torchtitan's own model, activation checkpointing, FSDP function, chunked loss
# and optimizers container, configured as the script configures its Trainer.
TITAN_SEQ, TITAN_BATCH = 64, 2


def _titan_config() -> Any:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:  # flex attention has no backward on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len = TITAN_SEQ
    config.training.local_batch_size = TITAN_BATCH
    config.optimizer.implementation = "foreach"  # "fused" is CUDA-only
    return config


def torchtitan_llama3() -> nn.Module:
    """torchtitan's debug model, built from its config as its Trainer builds it (the RoPE caches
    sized for the training's sequence length). Its ``init_weights`` is not called: under the
    estimate's FakeTensorMode the values do not matter, and truncated-normal init needs them."""
    config = _titan_config()
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    return model_config.build()


def torchtitan_wrap(model: nn.Module, *, mesh: Any, mp_policy: Any, reshard_after_forward: bool) -> nn.Module:
    """torchtitan's own selective activation checkpointing and FSDP (``apply_fsdp_to_decoder``), as
    its ``parallelize_llama`` applies them; SUM reductions, as the job on gloo sets them."""
    import tempfile

    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    config = _titan_config()
    with tempfile.TemporaryDirectory() as dump_folder:
        config.activation_checkpoint.build(dump_folder=dump_folder).apply(model)
    apply_fsdp_to_decoder(
        model, mesh, param_dtype=mp_policy.param_dtype or torch.float32,
        reduce_dtype=mp_policy.reduce_dtype or torch.float32, pp_enabled=False,
        reshard_after_forward_policy="default" if reshard_after_forward else "never")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


_TITAN_LOSSES: dict[int, Any] = {}


def torchtitan_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's default loss for the debug model: its ``ChunkedLossWrapper`` over the model's
    hidden states (``_skip_lm_head``), as its Trainer sets it up."""
    loss_fn = _TITAN_LOSSES.get(id(model))
    if loss_fn is None:
        config = _titan_config()
        loss_fn = _TITAN_LOSSES[id(model)] = config.loss.build(compile_config=config.compile)
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    pred = model(tokens)
    loss, _ = loss_fn(pred, tokens, torch.tensor(tokens.numel()))
    return loss


def torchtitan_optimizer(model: nn.Module, lr: float) -> Any:
    """torchtitan's ``OptimizersContainer`` (AdamW, foreach) over the model, as its Trainer builds it."""
    return _titan_config().optimizer.build(model_parts=[model])
