"""What light mode's saved-tensor pack hook costs per call, and its parts, in a loop (no FSDP).

Run (one process):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pack_cost.py [--n 20000] [--repeat 5]

Times, per call and as the minimum over ``--repeat`` loops of ``--n`` calls: the pack hook
(``SavedTensorAccounting._pack``) on a non-leaf tensor whose storage is new to the ledger and on one
it knows already, the unpack hook, and the torch calls a pack makes (``detach()``,
``untyped_storage()``, ``_version`` with ``is_leaf``) and a new storage's entry
(``Ledger.new_entry``). Run it with ``PYTHONPATH`` set to another version of the package to compare.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from fsdp_mem_otel.training.light.activations import SavedTensorAccounting, _unpack
from fsdp_mem_otel.training.light.ledger import INDEX, Ledger


def best_ns(fn: Callable[[list[Any]], None], make: Callable[[], list[Any]], repeat: int) -> float:
    """Nanoseconds per item of ``fn`` over a fresh ``make()`` list, the best of ``repeat`` loops."""
    best = float("inf")
    for _ in range(repeat):
        items = make()
        t0 = time.perf_counter()
        fn(items)
        best = min(best, (time.perf_counter() - t0) / len(items))
    return best * 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20000, help="calls per loop (default 20000)")
    p.add_argument("--repeat", type=int, default=5, help="loops; the best is printed (default 5)")
    args = p.parse_args()
    if args.n < 1 or args.repeat < 1:
        p.error(f"--n and --repeat: must be at least 1, got {args.n} and {args.repeat}")
    ledger = Ledger()
    ledger.defer(True)  # as in light mode: changes are queued, replayed when read
    acts = SavedTensorAccounting(ledger, lambda exc: None, ["layers.0"])
    acts.push()  # as in a forward: a pack accounts only while its hooks are pushed
    act = INDEX["activation"]
    weight = torch.ones(4, requires_grad=True)

    def non_leaves() -> list[torch.Tensor]:
        ledger.flush()
        return [weight * 2 for _ in range(args.n)]  # each a new storage, with a grad_fn

    known = non_leaves()
    for t in known:
        acts._pack(t)
    packed = [acts._pack(t) for t in known]

    def pack_all(ts: list[Any]) -> None:
        for t in ts:
            acts._pack(t)

    def unpack_all(ps: list[Any]) -> None:
        for x in ps:
            _unpack(x)

    def detach_all(ts: list[Any]) -> None:
        for t in ts:
            t.detach()

    def storage_all(ts: list[Any]) -> None:
        for t in ts:
            t.untyped_storage()

    def version_all(ts: list[Any]) -> None:
        for t in ts:
            t._version  # noqa: B018 - the getters are what is timed
            t.is_leaf  # noqa: B018

    def entries_all(sts: list[Any]) -> None:
        for st in sts:
            ledger.new_entry(st, act, None, "layers.0")

    rows = [
        ("pack, a new storage", best_ns(pack_all, non_leaves, args.repeat)),
        ("pack, a storage known already", best_ns(pack_all, lambda: known, args.repeat)),
        ("unpack", best_ns(unpack_all, lambda: packed, args.repeat)),
        ("detach()", best_ns(detach_all, lambda: known, args.repeat)),
        ("untyped_storage()", best_ns(storage_all, lambda: known, args.repeat)),
        ("_version and is_leaf", best_ns(version_all, lambda: known, args.repeat)),
        ("Ledger._new_entry, a new storage", best_ns(entries_all, lambda: [t.untyped_storage() for t in non_leaves()],
                                                     args.repeat)),
    ]
    acts.pop()
    print(f"torch {torch.__version__}; ns per call, best of {args.repeat} loops of {args.n}:")
    for name, ns in rows:
        print(f"  {name:<36} {ns:8.0f}")


if __name__ == "__main__":
    main()
