"""An HF Llama on one GPU under FSDP2, measured by the tracker and by the caching allocator side by
side: the CUDA tests (tests/training/test_cuda_llama.py) and benchmarks/gpu_cost.py use it.

``AllocatorWindows`` is the oracle for per-module peaks: it follows the tracker's own peak windows
(as the ledger's window watch, told of every module's forward and backward window edge) and, at
each of those moments, reads and resets the allocator's
``active_bytes`` and ``allocated_bytes`` peaks. A window's allocator peak is the largest reading
taken while it was open, so both sides measure the same stretch of the step; the step's is the
largest reading of all. Resetting the peaks at every window edge is why it runs in tests only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_mem_otel.schema import PEAK_BACKWARD, PEAK_FORWARD

#: big enough that kernels, not Python, set the step time on an H100/H200 (337M parameters, bf16)
CONFIG: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
    vocab_size=32000, max_position_embeddings=2048)
BATCH, SEQ = 4, 2048
PEAK_STATES = (PEAK_FORWARD, PEAK_BACKWARD)
_ACTIVE, _ALLOCATED = "active_bytes.all.peak", "allocated_bytes.all.peak"


def init_one_rank_nccl() -> None:
    """A 1-rank NCCL process group on GPU 0 (FSDP2 needs a group; one GPU is one rank)."""
    import torch.distributed as dist

    from tests.dist import free_ports

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)


def llama(checkpointing: bool = False, layers: int | None = None) -> nn.Module:
    """The unwrapped HF LlamaForCausalLM in bf16 on the default device (``estimate`` calls this
    under FakeTensorMode: ``tests.cuda_llama:llama``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(CONFIG, num_hidden_layers=layers or CONFIG["num_hidden_layers"])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as from_pretrained(dtype=bf16): rotary buffers stay fp32
    try:
        model = LlamaForCausalLM(LlamaConfig(**config))
    finally:
        torch.set_default_dtype(default)
    if checkpointing:  # HF's own: non-reentrant torch.utils.checkpoint per decoder layer
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def fsdp_wrap(model: nn.Module, **fsdp_kwargs: Any) -> nn.Module:
    """FSDP2 per decoder layer, then the root (embedding, final norm, lm_head); ``estimate --wrap
    tests.cuda_llama:fsdp_wrap`` passes its mesh and policies as ``fsdp_kwargs``."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """HF's own causal-LM loss (``estimate --loss tests.cuda_llama:next_token_loss``)."""
    return model(input_ids=ids, labels=ids).loss


def build(checkpointing: bool = False, compile_layers: bool = False, batch: int = BATCH,
          ) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """The sharded model on GPU 0, its AdamW and ``batch`` sequences of token ids.
    ``compile_layers``: each decoder layer compiled in place before sharding (torchtitan's way)."""
    with torch.device("cuda"):
        model = llama(checkpointing)
    if compile_layers:
        for layer in model.model.layers:  # type: ignore[union-attr]
            layer.compile()
    model = fsdp_wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, SEQ), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    return model, opt, ids


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    next_token_loss(model, ids).backward()
    opt.step()


def _peaks() -> tuple[int, int]:
    # the live counters (a resetting tracker shadows torch.cuda.memory_stats for the script)
    from fsdp_mem_otel.training.shadow_peaks import raw_stats

    stats = raw_stats(torch.cuda.current_device())
    return int(stats["active_bytes"]["all"]["peak"]), int(stats["allocated_bytes"]["all"]["peak"])


@dataclass
class _Open:
    active: int
    allocated: int


@dataclass
class AllocatorWindows:
    """The allocator's active and allocated peaks over the tracker's peak windows (module docstring).

    ``closed``: (active, allocated) peak of each window, in the order the ledger closed them, which
    is the order of the peak snapshots in the tracker's step log; ``step``: the largest readings;
    ``untracked``: at each close, what the allocator holds beyond the ledger's counters. A tracker
    with ``reset_peaks`` resets the peaks at the same edges itself: then the readings are taken
    just before its own, without resetting (``shared``).
    """

    closed: list[tuple[int, int]] = field(default_factory=list)
    untracked: list[int] = field(default_factory=list)
    step: tuple[int, int] = (0, 0)
    shared: bool = False
    device: str = "cuda:0"  # the ledger's device whose counters ``untracked`` subtracts
    _open: list[_Open] = field(default_factory=list)

    def read(self) -> None:
        active, allocated = _peaks()
        if not self.shared:
            torch.cuda.reset_peak_memory_stats()
        for w in self._open:
            w.active, w.allocated = max(w.active, active), max(w.allocated, allocated)
        self.step = (max(self.step[0], active), max(self.step[1], allocated))

    def start(self) -> None:
        self.closed.clear()
        self.untracked.clear()
        self._open.clear()
        self.step = (0, 0)
        torch.cuda.reset_peak_memory_stats()

    def watch(self, tracker: Any) -> None:
        """Follow ``tracker``'s peak windows as the ledger's window watch (``Counters.watch_windows``),
        chained to the tracker's own (``AllocatorTemps`` with ``reset_peaks``). A watched ledger
        applies each change at once (its window edges must be read in time), so a light tracker
        runs immediate here; ``tests/training/test_deferred.py`` holds the deferred ledger's
        figures equal to the immediate one's."""
        ledger = tracker.ledger
        inner = ledger.window_watch
        self.shared = inner is not None
        if self.shared:  # the tracker reads and resets at each edge: read just before it does
            probe, edge = tracker._probe, tracker._probe.window_edge

            def read_then_edge() -> Any:
                self.read()
                return edge()

            probe.window_edge = read_then_edge
        ledger.watch_windows(_Watch(self, ledger, inner))

    def _opened(self) -> None:
        self._open.append(_Open(*_peaks()))  # just reset: the peaks are what is allocated now

    def _closed(self, index: int, ledger: Any) -> None:
        w = self._open.pop(index)
        self.closed.append((w.active, w.allocated))
        self.untracked.append(torch.cuda.memory_allocated() - ledger.raw().get(self.device, [0])[-1])

    def module_peaks(self, tracker: Any) -> dict[tuple[str, str], tuple[int, int]]:
        """(module key, peak state) -> the allocator's largest (active, allocated) peak over that
        module's windows of the step just run (call before ``tracker.step()``)."""
        peaks = [(key, state) for key, state in tracker.recorder.logged if state in PEAK_STATES]
        assert len(peaks) == len(self.closed), (len(peaks), len(self.closed))
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for where, (active, allocated) in zip(peaks, self.closed, strict=True):
            a, b = out.get(where, (0, 0))
            out[where] = (max(a, active), max(b, allocated))
        return out


@dataclass
class _Watch:
    """The ledger's ``window_watch`` for ``AllocatorWindows``: read (unless the tracker's own watch,
    ``inner``, reads and resets) and mirror each window edge."""

    windows: AllocatorWindows
    ledger: Any
    inner: Any

    def opened(self, current: Any) -> None:
        if self.inner is None:
            self.windows.read()
        else:
            self.inner.opened(current)
        self.windows._opened()

    def closed(self, index: int, snap: Any) -> Any:
        if self.inner is None:
            self.windows.read()
        else:
            snap = self.inner.closed(index, snap)
        self.windows._closed(index, self.ledger)
        return snap

    def step_peak(self, peak: Any) -> Any:
        return peak if self.inner is None else self.inner.step_peak(peak)


def tracked_module_peaks(report: Any, device: str = "cuda:0") -> dict[tuple[str, str], int]:
    """(module key, peak state) -> the tracker's largest ``total`` on ``device`` for that window."""
    out = {}
    for key, mod in report.modules.items():
        for state in PEAK_STATES:
            calls = mod.snapshots.get(state, [])
            if calls:
                out[(key, state)] = max(c.get(device, {}).get("total", 0) for c in calls)
    return out
