"""Scale benchmark for ``fsdp-mem-otel report``: a synthetic large run, then the command, timed.

Writes one JSONL file per rank in the exporter's exact format (``StepReport.to_dict()``, sorted
keys, one line per step): every step carries a full module breakdown (each module x 10 FSDP states
x 12 categories on ``cuda:<rank>``, with times), every ``--deep-every``-th step is deep, and a few
steps per rank are aborted by an injected OOM. Then it runs ``python -m fsdp_mem_otel.offline.report`` on
them in a subprocess (so import time counts) and prints the page size and wall time. Like
``JSONLExporter``, it writes each file's side index ``<file>.index`` with the exporter's own
``index_line`` (``--no-index`` leaves it out, to time the full scan).

    python benchmarks/report_scale.py                       # 10,000 steps x 100 modules x 8 ranks
    python benchmarks/report_scale.py --steps 1000 --ranks 2 --modules 20   # a quick one

At full size the JSONL set is large (about 3.3 GB per rank, 26 GB in all: each line holds ~330 KB
of module snapshots), so the temp directory needs that much free space; ``--dir`` picks where.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdp_mem_otel.exporters.jsonl import index_line, index_path  # noqa: E402
from fsdp_mem_otel.schema import CATEGORIES, STATES, TOTAL, ModuleReport, StepAbort, StepReport  # noqa: E402

STATE_LIST = [s for s in STATES if not s.endswith("_ac")]  # the 10 states a plain FSDP module reaches
GIB = 1 << 30
VARIANTS = 4


def breakdown(dev: str, base: int, act: int, extra: int) -> dict[str, dict[str, int]]:
    cats = dict.fromkeys(CATEGORIES, 0)
    cats.update(sharded_param=base, sharded_grad=base // 2, optimizer_state=2 * base, activation=act,
                all_gather=extra, unsharded_param=extra, inputs=1 << 20)
    cats[TOTAL] = sum(cats.values())
    return {dev: cats}


def modules_blob(rank: int, n_modules: int, variant: int) -> tuple[str, list[str]]:
    """The ``"modules"`` JSON text of one step (exactly as json.dumps(sort_keys=True) writes it)."""
    dev = f"cuda:{rank}"
    keys = ["<root>"] + [f"layers.{i}" for i in range(n_modules - 1)]
    base = 4 * GIB + rank * 64 * (1 << 20)
    t0 = 1_790_000_000_000_000_000
    mods = {}
    for i, key in enumerate(keys):
        snaps: dict[str, list[dict[str, dict[str, int]]]] = {}
        times: dict[str, list[int]] = {}
        for k, state in enumerate(STATE_LIST):
            fwd = k < 4 or state == "peak_forward"
            act = (i + 1 if fwd else n_modules - i) * (40 << 20) * (1 + variant % 3)
            extra = (256 << 20) if state.startswith("after_pre") or state.startswith("peak") else 0
            snaps[state] = [breakdown(dev, base, act, extra)]
            t = t0 + (i * 1000 + k if fwd else 10**9 + (n_modules - i) * 1000 + k)
            times[state] = [t]
        mods[key] = ModuleReport(snaps, times).to_dict()
    return json.dumps(mods, sort_keys=True), keys


def write_rank(path: Path, rank: int, ranks: int, steps: int, n_modules: int, deep_every: int,
               aborted: set[int], index: bool = True, modules_every: int = 1) -> None:
    blobs = [modules_blob(rank, n_modules, v) for v in range(VARIANTS)]
    keys = blobs[0][1]
    dev = f"cuda:{rank}"
    seed = 12345 + rank
    offset = 0
    modules_step = 1
    with open(path, "wb", buffering=16 << 20) as f, \
            open(index_path(str(path)) if index else os.devnull, "wb", buffering=1 << 20) as fi:
        for step in range(1, steps + 1):
            seed = (seed * 1103515245 + 12345) & 0x7FFFFFFF
            jitter = seed % (512 << 20)
            act = (8 * GIB if step % 97 else 12 * GIB) + jitter + rank * (128 << 20)
            peak = breakdown(dev, 4 * GIB, act, 1 * GIB)
            total = peak[dev][TOTAL]
            abort = None
            if step in aborted:
                abort = StepAbort("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", True,
                                  f"layers.{n_modules // 2}", "after_pre_backward", peak)
            report = StepReport(
                step=step, rank=rank, world_size=ranks, mode="deep" if deep_every and step % deep_every == 0
                else "light", fsdp_version=2, peak=peak, modules={}, module_order=keys, current=peak,
                allocator={dev: {"allocated_bytes": float(total - (1 << 30)), "reserved_bytes": float(total + GIB),
                                 "allocated_peak_bytes": float(total + (64 << 20)),
                                 "reserved_peak_bytes": float(total + GIB + (256 << 20)),
                                 "fragmentation_ratio": 0.05, "device_total_bytes": 80.0 * GIB},
                           "cpu": {"resident_bytes": float(12 * GIB)}},
                local_rank=rank, duration_seconds=0.5, tracker_overhead_seconds=0.001, timestamp=1.79e9 + step,
                start_time_ns=step * 10**9, end_time_ns=step * 10**9 + 5 * 10**8, aborted=abort,
            )
            full = (step == 1 or report.mode == "deep" or abort is not None or modules_every <= 1
                    or step % modules_every == 0)
            if full:
                modules_step = step
                d = report.to_dict()
                d["modules"] = "@MODULES@"
                line = (json.dumps(d, sort_keys=True).replace('"@MODULES@"', blobs[step % VARIANTS][0], 1)
                        + "\n").encode("utf-8")
            else:  # as JSONLExporter writes a step under its JSONL budget: the snapshots of modules_step
                report.module_order, report.modules_from = [], modules_step
                d = report.to_dict()
                line = (json.dumps(d, sort_keys=True) + "\n").encode("utf-8")
            f.write(line)
            if index:
                fi.write(index_line(d, offset, len(line)))  # d's modules are left out of the entry
            offset += len(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--modules", type=int, default=100)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--deep-every", type=int, default=10, help="every Nth step deep (default 10)")
    p.add_argument("--modules-every", type=int, default=1,
                   help="module snapshots on every Nth step (and the first, deep and aborted ones), as the "
                        "exporter's JSONL budget writes them; the other lines refer back (default 1: every line)")
    p.add_argument("--max-seconds", type=float, default=30.0, help="goal: the report's wall time (default 30)")
    p.add_argument("--max-rss-gb", type=float, default=None, help="goal: the report's peak memory (default none)")
    p.add_argument("--max-page-mb", type=float, default=20.0, help="goal: the page's size (default 20)")
    p.add_argument("--dir", default=None, help="where to write the JSONL set (default: a new temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the JSONL set and the page")
    p.add_argument("--no-index", action="store_true", help="write no side index (times the full scan)")
    p.add_argument("--reuse", action="store_true", help="use the JSONL set already in --dir (no generation)")
    p.add_argument("--drop-caches", action="store_true",
                   help="sync and drop the page cache before the report (root only), to time a cold read")
    args = p.parse_args()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="report_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    aborted = {args.steps // 3, args.steps // 2, args.steps - 5}
    try:
        t0 = time.perf_counter()
        files = []
        for rank in range(args.ranks):
            path = work / f"run.rank{rank}.jsonl"
            if not args.reuse:
                write_rank(path, rank, args.ranks, args.steps, args.modules, args.deep_every, aborted,
                           index=not args.no_index, modules_every=args.modules_every)
            files.append(str(path))
            if rank < 8 or rank % 64 == 0 or rank == args.ranks - 1:
                print(f"generated {path} ({path.stat().st_size / 1e9:.2f} GB; rank {rank + 1} of {args.ranks})",
                      flush=True)
        data_bytes = sum(os.path.getsize(f) for f in files)
        print(f"generated {args.steps} steps x {args.modules} modules x {args.ranks} ranks: "
              f"{data_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
        out = work / "report.html"
        if args.drop_caches:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        cmd = [sys.executable, "-m", "fsdp_mem_otel.offline.report", *files, "-o", str(out)]
        t1 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=REPO)
        seconds = time.perf_counter() - t1
        rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9  # Linux: KiB
        size = out.stat().st_size
        print(f"report: {size / 1e6:.1f} MB page in {seconds:.1f} s, peak RSS {rss_gb:.2f} GB "
              f"({args.steps} steps x {args.modules} modules x {args.ranks} ranks, {data_bytes / 1e9:.1f} GB JSONL)")
        goal = f"under {args.max_page_mb:g} MB and {args.max_seconds:g} s" + (
            "" if args.max_rss_gb is None else f" and {args.max_rss_gb:g} GB")
        ok = size < args.max_page_mb * 1e6 and seconds < args.max_seconds and (
            args.max_rss_gb is None or rss_gb < args.max_rss_gb)
        print(f"PASS ({goal})" if ok else f"FAIL (goal: {goal})")
        return 0 if ok else 1
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
