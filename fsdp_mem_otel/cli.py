"""The ``fsdp-mem-otel`` command."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    """Launch a real 2-rank FSDP training on CPU (gloo) under torchrun, with the tracker on."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
        "-m", "fsdp_mem_otel.demo", *rest,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"launching {args.nproc} ranks: {' '.join(cmd[2:])}", flush=True)
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-mem-otel", description="Per-module FSDP memory tracking.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run a real 2-rank FSDP training on CPU with the tracker and print per-module tables",
        description="Run a real FSDP training on CPU (gloo) with the tracker; options after the "
        "known ones go to the rank processes: --steps N --fsdp 1|2 --blocks N --width N --batch N "
        "--mode light|deep --deep-every N.",
    )
    demo.add_argument("--nproc", type=int, default=2, help="ranks to launch (default 2)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from fsdp_mem_otel.demo import _add_demo_args

        check = argparse.ArgumentParser(prog="fsdp-mem-otel demo")
        _add_demo_args(check)
        check.parse_args(rest)  # reject bad options here, before starting ranks
        return _demo(args, rest)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
