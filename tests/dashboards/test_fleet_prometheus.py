"""The fleet budget on a real Prometheus: no dashboard query reads more than 10,000 series at
1,024 ranks x 100 modules, and none loads more than Prometheus' default query.max-samples over
its default 3 h range.

A synthetic fleet of two jobs (256 and 128 ranks, 100 FSDP modules each, 8 ranks per pod behind
the shipped sidecar) is rendered by the package's own exposition code and scraped by a real
Prometheus with the shipped recording rules (tests/dashboards/fleet.py). Every dashboard target
runs with its variables at their widest defaults. Series counts grow linearly with a job's ranks,
so the two jobs give each query's cost per rank, and the budget is checked at 256 ranks as
measured and at 1,024 ranks projected from that slope (benchmarks/fleet.py measures 1,024 ranks
directly). Every rank leaks (as many leak series as a rank exports), so the leak panels are measured
too; the hours to device capacity need memory that grows over the rules' forecast window, which this
static fleet does not, so those targets (test_dashboards.EXPECTED_GROWTH_ONLY) may be empty here
(tests/dashboards/test_live_prometheus.py checks them on growing memory).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_mem_otel.fleet import alerts
from fsdp_mem_otel.schema import TOTAL
from tests.dashboards.fleet import (
    MAX_SAMPLES,
    SERIES_BUDGET,
    Job,
    QueryCost,
    api,
    fleet,
    query_costs,
    rank_report,
)
from tests.dashboards.test_dashboards import EXPECTED_GROWTH_ONLY

BIG, SMALL, TARGET = Job("big", 256), Job("small", 128), 1024
MODULES = 100
SCRAPE = 4.0  # the rules take ~3 s per pass at this size on 2 cores: a 2 s interval skips passes


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = Path(tmp_path_factory.mktemp("fleet"))
    with fleet([BIG, SMALL], MODULES, interval=f"{SCRAPE:g}s", rounds=5, workdir=workdir) as (base, start, end):
        yield {
            "base": base, "end": end,
            "big": query_costs(base, BIG.name, start, end, SCRAPE),
            "small": query_costs(base, SMALL.name, start, end, SCRAPE),
        }


def _key(c: QueryCost) -> tuple[str, str, str]:
    return c.dashboard, c.panel, c.ref


def _projected(big: QueryCost, small: QueryCost, field: str) -> float:
    """``field`` of the query at TARGET ranks, from its growth between the two jobs."""
    b, s = getattr(big, field), getattr(small, field)
    return b + (b - s) / (BIG.ranks - SMALL.ranks) * (TARGET - BIG.ranks)


def test_every_dashboard_query_answers_on_the_fleet(measured: dict[str, Any]) -> None:
    costs = measured["big"]
    assert len(costs) >= 40
    silent = [f"{c.dashboard} / {c.panel} / {c.ref}: {c.expr}" for c in costs
              if not c.answered and _key(c) not in EXPECTED_GROWTH_ONLY]
    assert not silent, "\n".join(silent)  # a query that reads nothing would pass any budget


def test_no_query_reads_more_than_the_series_budget(measured: dict[str, Any]) -> None:
    small = {_key(c): c for c in measured["small"]}
    over = []
    for c in measured["big"]:
        at_target = _projected(c, small[_key(c)], "series")
        if c.series > SERIES_BUDGET or at_target > SERIES_BUDGET:
            over.append(f"{c.dashboard} / {c.panel} / {c.ref}: {c.series} series at {BIG.ranks} ranks, "
                        f"{at_target:.0f} at {TARGET}\n  {c.expr}")
    assert not over, "\n".join(over)


def test_no_query_exceeds_max_samples_over_its_default_range(measured: dict[str, Any]) -> None:
    small = {_key(c): c for c in measured["small"]}
    over = [f"{c.dashboard} / {c.panel} / {c.ref}: {_projected(c, small[_key(c)], 'projected_samples'):.3g}"
            for c in measured["big"] if _projected(c, small[_key(c)], "projected_samples") > MAX_SAMPLES]
    assert not over, "\n".join(over)


def test_the_budget_check_catches_a_raw_module_x_rank_query(measured: dict[str, Any]) -> None:
    # what the drill-down's heatmaps read before the recorded series: one series per rank x module
    raw = f'max by (module, rank) (fsdp_mem_module_peak_bytes{{job_name="{BIG.name}", phase="forward"}})'
    got = api(measured["base"], "/api/v1/query", {"query": f"count({raw})", "time": measured["end"]})["result"]
    assert int(float(got[0]["value"][1])) == BIG.ranks * MODULES > SERIES_BUDGET


def test_recorded_series_hold_the_fleet_arithmetic(measured: dict[str, Any]) -> None:
    base, end = measured["base"], measured["end"]

    def one(expr: str) -> float:
        got = api(base, "/api/v1/query", {"query": expr, "time": end})["result"]
        assert len(got) == 1, (expr, got)
        return float(got[0]["value"][1])

    for job in (BIG, SMALL):
        sel = f'{{job_name="{job.name}"}}'
        peaks = [max(v[TOTAL] for v in rank_report(r, job.ranks, 2).peak.values()) for r in range(job.ranks)]
        assert one(f"{alerts.REC_JOB_RANKS}{sel}") == job.ranks
        assert one(f"{alerts.REC_JOB_PEAK_MAX}{sel}") == max(peaks)
        assert one(f"{alerts.REC_JOB_PEAK_MIN}{sel}") == min(peaks)
        assert one(f"count({alerts.REC_JOB_MODULE_PEAK}{sel})") == 2 * MODULES  # forward and backward
        assert one(f"count({alerts.REC_JOB_MODULE_PEAK_RANK}{sel})") == 2 * MODULES  # one rank holds each
        assert one(f"{alerts.REC_JOB_STALE}{sel}") == 0
        leaks = [rank_report(r, job.ranks, 2).leak for r in range(job.ranks)]
        growth = [leak.growing["activation"] for leak in leaks if leak is not None]
        assert len(growth) == job.ranks
        assert one(f'{alerts.REC_JOB_CATEGORY_LEAK}{{job_name="{job.name}",category="activation"}}') == max(growth)
