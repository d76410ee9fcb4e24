"""The dashboards on a real Prometheus holding a synthetic 1,024-rank x 100-module job.

Every rank's series come from the package's own exposition code (``PrometheusExporter`` writing
the rank's sidecar file, ``serve.SidecarCollector`` merging a pod's 8 rank files), a real
Prometheus (Debian's ``prometheus``) scrapes every pod with the shipped recording rules, and every
panel target of every dashboard runs with its variables at their widest defaults. Per query it
prints the series its selectors read, Prometheus' own sample statistics over the scraped window,
the samples projected to the dashboard's default 3 h range at a 15 s scrape interval, and the
latency (the machinery is ``tests/dashboards/fleet.py``, shared with the CI test at 256 ranks).

    python benchmarks/fleet.py                         # 1,024 ranks x 100 modules
    python benchmarks/fleet.py --ranks 256 --modules 20  # a quick one

Prints a Markdown table (largest series first) and the budget verdicts; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdp_mem_otel.checks import int_at_least  # noqa: E402
from tests.dashboards.fleet import (  # noqa: E402
    MAX_SAMPLES,
    SERIES_BUDGET,
    Job,
    fleet,
    query_costs,
    series_total,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int_at_least(8), default=1024, help="ranks of the job (default 1024)")
    p.add_argument("--modules", type=int_at_least(2), default=100, help="FSDP modules per rank (default 100)")
    p.add_argument("--scrape", type=int_at_least(1), default=10, help="scrape interval in seconds (default 10)")
    p.add_argument("--rounds", type=int_at_least(2), default=4, help="scrapes before querying (default 4)")
    p.add_argument("--dir", default=None, help="where the pods' files and the TSDB go (default: a temp dir)")
    args = p.parse_args()

    def progress(msg: str) -> None:
        print(f"[fleet] {msg}", file=sys.stderr, flush=True)

    job = Job(f"llm-{args.ranks}", args.ranks)
    t0 = time.monotonic()
    with fleet([job], args.modules, interval=f"{args.scrape}s", rounds=args.rounds, progress=progress,
               workdir=Path(args.dir) if args.dir else None) as (base, start, end):
        ready = time.monotonic() - t0
        total = series_total(base)
        progress(f"{total} series in Prometheus; running every dashboard query")
        costs = query_costs(base, job.name, start, end, float(args.scrape))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(f"## {args.ranks} ranks x {args.modules} modules ({args.ranks // 8} pods of 8 ranks), "
          f"scraped every {args.scrape} s\n")
    print(f"{total:,} series in Prometheus; render + ingest + rules {ready:.0f} s; this process's peak RSS "
          f"{rss:.0f} MiB; {len(costs)} queries\n")
    print("| dashboard | panel | ref | series read | samples (window) | peak samples | samples at 3 h | seconds |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for c in sorted(costs, key=lambda c: (-c.series, c.dashboard, c.panel)):
        print(f"| {c.dashboard} | {c.panel} | {c.ref} | {c.series:,} | {c.samples:,} | {c.peak_samples:,} | "
              f"{c.projected_samples:,} | {c.seconds:.3f} |")
    worst_series = max(costs, key=lambda c: c.series)
    worst_samples = max(costs, key=lambda c: c.projected_samples)
    slowest = max(costs, key=lambda c: c.seconds)
    silent = [c for c in costs if not c.answered]
    print(f"\nlargest read: {worst_series.series:,} series ({worst_series.dashboard} / {worst_series.panel}); "
          f"budget {SERIES_BUDGET:,}: {'met' if worst_series.series <= SERIES_BUDGET else 'MISSED'}")
    print(f"largest 3 h load: {worst_samples.projected_samples:,} samples ({worst_samples.dashboard} / "
          f"{worst_samples.panel}); query.max-samples {MAX_SAMPLES:,}: "
          f"{'met' if worst_samples.projected_samples <= MAX_SAMPLES else 'MISSED'}")
    print(f"slowest: {slowest.seconds:.3f} s ({slowest.dashboard} / {slowest.panel}); "
          f"queries without data: {len(silent)}")
    return 0 if worst_series.series <= SERIES_BUDGET and worst_samples.projected_samples <= MAX_SAMPLES else 1


if __name__ == "__main__":
    raise SystemExit(main())
