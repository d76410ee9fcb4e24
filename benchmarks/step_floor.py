"""The tracked step against the untracked one with no timer anywhere, and the floor of its entry points.

Run (one process is the quiet case; any number of ranks works):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 1 benchmarks/step_floor.py [--blocks 16] [--steps 30] [--rounds 9]
        [--model llama]   (an HF Llama instead of the demo's MLP blocks: see hook_timing.py)

``hook_timing.py`` times each entry point in place; its timers cost about as much as small
entries, and its "tracked step" takes an estimate of them out. Here nothing is timed but whole
steps (training-thread CPU, median per run), and each round measures every variant between two
untracked runs of the same steps, in alternating order; a variant's ratio is its step over the
mean of the round's two untracked ones, and the median over rounds is printed. Variants:

- ``light``: the tracker as shipped (light mode, activations on);
- ``light-noact``: the same with ``TrackerConfig(activations=False)``;
- ``installed``: every hook and wrapper installed, every entry point returning at once (the
  ``--stub-all`` of ``hook_timing.py``: step() and track_inputs as they are, the saved-tensor
  hooks pushed, packing a detached alias): what merely having today's entry points costs;
- ``installed-noact``: the same without saved-tensor hooks.

Two more, by hook family, to size what folding it into FSDP's own hooks could save at most
(FSDP2; not in the default list): ``installed-noact-nofwd``, the same as ``installed-noact`` with
the adapter's four forward hooks per module removed after attach, and
``installed-noact-nogroups``, with the FSDP2 group methods put back unwrapped.

And one with no tracker at all, to size what autograd's saved-tensor hooks cost by themselves:
``torch-hooks`` pushes a pack hook that hands autograd the tensor (a leaf) or a detached alias and
an identity unpack around the model's forward, as light mode does, with nothing else: PyTorch's
mechanism plus two trivial Python calls per saved tensor, the floor of any activation accounting
through those hooks.

Reports of the ``installed`` variants are not valid. ``--json PATH`` writes the figures (rank 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.tools.demo import init_distributed
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import hook_timing  # noqa: E402 - the stubs live beside it (benchmarks/ is no package)

VARIANTS = ("light", "light-noact", "installed", "installed-noact")
BY_FAMILY = ("installed-noact-nofwd", "installed-noact-nogroups", "torch-hooks")


def _pack(t: Any) -> Any:
    return t if t.is_leaf else t.detach()


def _unpack(t: Any) -> Any:
    return t


def saved_tensor_hooks_only(model: Any) -> Callable[[], None]:
    """``torch-hooks``: our pack and unpack pushed around ``model``'s forward, no tracker; returns
    the undo."""
    hooks = torch._C._autograd
    handles = [model.register_forward_pre_hook(lambda *_: hooks._push_saved_tensors_default_hooks(_pack, _unpack),
                                               prepend=True),
               model.register_forward_hook(lambda *_: hooks._pop_saved_tensors_default_hooks(), always_call=True)]

    def undo() -> None:
        for h in handles:
            h.remove()

    return undo


def strip(tracker: FSDPMemoryTracker, variant: str) -> None:
    """Take one hook family of an attached tracker's FSDP2 adapter out (``BY_FAMILY``)."""
    adapter: Any = tracker._adapter
    if variant.endswith("-nofwd"):
        for handle in adapter._handles:  # the forward hooks (and unmanaged parameters' grad hooks)
            handle.remove()
        adapter._handles.clear()
    elif variant.endswith("-nogroups"):
        for saved in reversed(adapter._saved):  # the group methods' wrappers, as detach() undoes them
            if saved.existed:
                setattr(saved.owner, saved.name, saved.value)
            else:
                delattr(saved.owner, saved.name)
        adapter._saved.clear()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=hook_timing.MODELS, default="mlp",
                   help="the demo's MLP blocks (default) or an HF Llama, as in hook_timing.py")
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    p.add_argument("--rounds", type=int, default=9, help="rounds (default 9)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, from {', '.join(VARIANTS + BY_FAMILY)} (default: {', '.join(VARIANTS)})")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    unknown = [v for v in unknown if v not in BY_FAMILY]
    if unknown or not variants:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; "
                f"accepted: {', '.join(VARIANTS + BY_FAMILY)}")
    for name in ("blocks", "width", "batch", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    rank, _ = init_distributed()
    model, opt, xs, train, label = hook_timing.build_model(args.model, args.blocks, args.width, args.batch,
                                                           args.steps, rank)

    def run(tracker: Any) -> float:
        gc.collect()  # a dropped tracker's cycles and entries collected here, not inside a timed run
        return hook_timing.step_cpu(model, opt, xs, tracker, train)

    def tracked(variant: str) -> float:
        if variant == "torch-hooks":
            undo = saved_tensor_hooks_only(model)
            try:
                run(None)  # warm-up, as the tracked variants
                return run(None)
            finally:
                undo()
        restore: Callable[[], None] | None = hook_timing.stub_all() if variant.startswith("installed") else None
        try:
            config = TrackerConfig(activations="-noact" not in variant)
            with FSDPMemoryTracker(model, opt, config=config) as tracker:
                strip(tracker, variant)
                run(tracker)  # warm-up: first entries, learnt sizes
                return run(tracker)
        finally:
            if restore is not None:
                restore()

    run(None)  # warm-up: optimizer state, allocator
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    bases: list[float] = []
    for r in range(args.rounds):
        before = run(None)
        steps = {v: tracked(v) for v in (variants if r % 2 == 0 else variants[::-1])}
        base = (before + run(None)) / 2
        bases.append(base)
        for v, t in steps.items():
            ratios[v].append(t / base)
        if rank == 0:
            print(f"round {r + 1}: untracked {base * 1e3:.2f} ms CPU; "
                  + ", ".join(f"{v} {ratios[v][-1]:.3f}x" for v in variants), flush=True)
    label = f"{label}, {dist.get_world_size()} rank(s)"
    if rank == 0:
        print(f"{label}: untracked step {statistics.median(bases) * 1e3:.2f} ms CPU (median); "
              f"tracked over untracked, median of {args.rounds} rounds:")
        for v in variants:
            rs = ratios[v]
            print(f"  {v:<16} {statistics.median(rs):.3f}x  (min {min(rs):.3f}x, max {max(rs):.3f}x)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "blocks": args.blocks, "width": args.width, "batch": args.batch,
                           "world_size": dist.get_world_size(), "steps": args.steps,
                           "untracked_ms": [b * 1e3 for b in bases], "ratios": ratios,
                           "median": {v: statistics.median(rs) for v, rs in ratios.items()}}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
