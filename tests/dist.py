"""Run a function on 2 real ranks (gloo, CPU) in fresh processes and collect what each returns.

The ranks are forked from a forkserver that has imported torch once (started at the first
``run_ranks`` of the test session): a rank then starts in a fraction of a second instead of the
~2 s a spawned interpreter takes to import torch, and ~200 calls add up. Each rank still starts
from a process that has run nothing but those imports, with the caller's current environment.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

#: the ranks of a run_ranks() call (its default world size), for parametrizing over its results
WORLD_SIZE = 2
RANKS = tuple(range(WORLD_SIZE))


def free_ports(n: int = 1) -> int:
    """A port p such that p .. p+n-1 are all free on 127.0.0.1 right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports")


#: imported once by the forkserver, before it forks any rank
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp"]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], q: Any,
           env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment, not the forkserver's (started earlier)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            q.put((rank, "ok", fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = WORLD_SIZE, timeout: float = 300) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks; returns the per-rank results, rank order.

    ``fn`` must be importable (a module-level function) and return picklable data.
    """
    import queue
    import time

    import torch.multiprocessing as mp  # here, not at the top: free_ports() serves torch-free tests too

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # used when the server starts (the first call)
    q = ctx.Queue()
    port = free_ports()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, q, env)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    # Drain while the ranks run: a large result would otherwise block its sender on a full pipe.
    while len(results) + len(errors) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = q.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and q.empty():
                break
            continue
        if status == "ok":
            results[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(5 if len(results) == world_size else 1)
        if p.is_alive():
            p.kill()
            p.join()
    if errors or len(results) != world_size:
        codes = {r: p.exitcode for r, p in enumerate(procs)}  # negative: killed by that signal
        detail = errors or [f"only ranks {sorted(results)} returned (timeout {timeout}s or a crash; "
                            f"exit codes {codes})"]
        raise RuntimeError("distributed test failed:\n" + "\n".join(detail))
    return [results[r] for r in range(world_size)]
