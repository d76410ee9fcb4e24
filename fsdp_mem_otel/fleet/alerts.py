"""Prometheus alert and recording rules, and the same rules as a PrometheusRule. Standard library
plus PyYAML (only to write the files). ``fsdp-mem-otel rules`` (``rules_command.py``) writes them
with the dashboards' ConfigMaps.

Every metric name comes from ``fsdp_mem_otel.fleet.catalog``, so a rename happens in one place;
``fsdp-mem-otel rules --out deploy/prometheus/`` rewrites the committed files (a test
regenerates them and fails on any difference).

Label conventions the rules rely on: every rank series carries the identity labels
``job_name`` and ``rank`` (``Identity.labels()``), and ``namespace`` (the pod's, from the
downward API, or the scrape target's). Rules aggregate ``by (namespace, job_name[, rank])``,
so the result does not depend on the scrape configuration's own labels (``job``, ``instance``,
``pod``, ``container``).

Thresholds are ``RuleConfig`` fields (and ``rules`` command options); the committed files use the
defaults.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.fleet.k8s_files import HEADER, dashboards_configmaps, to_yaml

__all__ = ["DASHBOARDS_FILE", "HEADER", "PROMETHEUS_RULE_FILE", "RULES_FILE", "RuleConfig", "alert_rules",
           "dashboards_configmaps", "prometheus_rule", "recording_rules", "rule_groups", "to_yaml"]

RULES_FILE = "fsdp-mem-otel.rules.yml"
PROMETHEUS_RULE_FILE = "prometheusrule.yaml"
DASHBOARDS_FILE = "grafana-dashboards.yaml"

#: labels a job-level series keeps
JOB = ("namespace", "job_name")
#: labels a rank-level series keeps
RANK = (*JOB, "rank")

# -- recording rules (names follow level:metric:operations) -------------------------------------
REC_RANK_PEAK = "namespace_job_name_rank:fsdp_mem_step_peak_bytes:max"
REC_JOB_PEAK_MAX = "namespace_job_name:fsdp_mem_step_peak_bytes:max"
REC_JOB_PEAK_MIN = "namespace_job_name:fsdp_mem_step_peak_bytes:min"
REC_JOB_RANK_SKEW = "namespace_job_name:fsdp_mem_step_peak_bytes:rank_skew_ratio"
#: per rank x CUDA device: what runs out on the device, the largest of the tracked step peak and the
#: allocator's allocated, active and reserved peaks of the step (``device_peak_expression``)
REC_RANK_DEVICE_PEAK = "namespace_job_name_rank_device:fsdp_mem_device_peak_bytes:max"
#: ... over the device's total memory (FsdpMemNearDeviceCapacity)
REC_DEVICE_RATIO = "namespace_job_name_rank_device:fsdp_mem_device_peak_bytes:device_total_ratio"
#: per job x category: the largest step-peak bytes of the category over the job's ranks
REC_JOB_CATEGORY_PEAK = "namespace_job_name_category:fsdp_mem_step_peak_bytes:max"
#: per job x module x phase: the module's peak over the ranks ...
REC_JOB_MODULE_PEAK = "namespace_job_name_module_phase:fsdp_mem_module_peak_bytes:max"
#: ... and the same with the ``rank`` that holds it (one rank per module and phase)
REC_JOB_MODULE_PEAK_RANK = "namespace_job_name_module_phase_rank:fsdp_mem_module_peak_bytes:topk1"
#: per job x module x phase: (max - min) / max over the ranks
REC_JOB_MODULE_SKEW = "namespace_job_name_module_phase:fsdp_mem_module_peak_bytes:rank_skew_ratio"
#: per job x category: the smallest rank's step-peak bytes of the category (each rank's largest device)
REC_JOB_CATEGORY_PEAK_MIN = "namespace_job_name_category:fsdp_mem_step_peak_bytes:min"
#: per job x category: live bytes at the step end, summed over the ranks
REC_JOB_CATEGORY_CURRENT = "namespace_job_name_category:fsdp_mem_current_bytes:sum"
#: per job x module: the slowest rank's forward seconds
REC_JOB_MODULE_FORWARD = "namespace_job_name_module:fsdp_mem_module_forward_seconds:max"
# -- per job, for the fleet overview (one series per job, whatever its size) ---------------------
REC_JOB_RANKS = "namespace_job_name:fsdp_mem_tracker_info:ranks"
REC_JOB_STALE = "namespace_job_name:fsdp_mem_sidecar_rank_stale:sum"
#: counters summed over the ranks; read them with increase(). A rank's counter reset would look
#: like a reset of the sum, but FSDP ranks restart together (torchrun restarts the whole job)
REC_JOB_OOMS = "namespace_job_name:fsdp_mem_allocator_ooms_total:sum"
REC_JOB_RETRIES = "namespace_job_name:fsdp_mem_allocator_alloc_retries_total:sum"
REC_JOB_ERRORS = "namespace_job_name_component:fsdp_mem_errors_total:sum"
#: the job's lowest headroom: device total minus device peak (REC_RANK_DEVICE_PEAK), over its ranks' CUDA devices
REC_JOB_HEADROOM = "namespace_job_name:fsdp_mem_device_headroom_bytes:min"
#: the job's largest process resident bytes (CPU-only jobs' stand-in for headroom)
REC_JOB_RESIDENT = "namespace_job_name:fsdp_mem_process_resident_bytes:max"
REC_JOB_DEVICE_RATIO = "namespace_job_name:fsdp_mem_device_peak_bytes:device_total_ratio_max"
#: the job's largest allocator reserved peak (over its ranks' CUDA devices), beside REC_JOB_PEAK_MAX
REC_JOB_RESERVED_PEAK = "namespace_job_name:fsdp_mem_allocator_reserved_peak_bytes:max"
#: the job's largest gap, over its ranks' CUDA devices, between the allocator's reserved peak and
#: the tracked step peak: what the tracker's categories do not show (cache, fragmentation, and op
#: temporaries where the allocator's peaks are not reset)
REC_JOB_PEAK_GAP = "namespace_job_name:fsdp_mem_allocator_peak_gap_bytes:max"
#: the oldest last-step timestamp over the job's ranks (its slowest rank)
REC_JOB_LAST_STEP = "namespace_job_name:fsdp_mem_last_step_timestamp_seconds:min"
#: the largest tracker overhead over step time among the job's ranks
REC_JOB_OVERHEAD = "namespace_job_name:fsdp_mem_step_overhead_seconds:max_ratio"
#: per job x category: the fastest-growing rank's leak growth, bytes per step (only while one grows)
REC_JOB_CATEGORY_LEAK = "namespace_job_name_category:fsdp_mem_leak_growth_bytes_per_step:max"
#: per rank x CUDA device: hours until the device peak (REC_RANK_DEVICE_PEAK) or the step-end bytes
#: reach the device's capacity at their steady growth over ``RuleConfig.forecast_window``
#: (see ``forecast_expression``)
REC_RANK_HOURS = "namespace_job_name_rank_device:fsdp_mem_hours_to_capacity:predict_linear"
#: ... and per job, its first rank to get there
REC_JOB_HOURS = "namespace_job_name:fsdp_mem_hours_to_capacity:min"
RECORDING_NAMES: tuple[str, ...] = (REC_RANK_PEAK, REC_JOB_PEAK_MAX, REC_JOB_PEAK_MIN, REC_JOB_RANK_SKEW,
                                    REC_RANK_DEVICE_PEAK, REC_DEVICE_RATIO, REC_JOB_CATEGORY_PEAK,
                                    REC_JOB_CATEGORY_PEAK_MIN,
                                    REC_JOB_CATEGORY_CURRENT, REC_JOB_MODULE_PEAK, REC_JOB_MODULE_PEAK_RANK,
                                    REC_JOB_MODULE_SKEW, REC_JOB_MODULE_FORWARD, REC_JOB_RANKS, REC_JOB_STALE,
                                    REC_JOB_OOMS, REC_JOB_RETRIES, REC_JOB_ERRORS, REC_JOB_HEADROOM,
                                    REC_JOB_RESIDENT, REC_JOB_DEVICE_RATIO, REC_JOB_RESERVED_PEAK,
                                    REC_JOB_PEAK_GAP, REC_JOB_LAST_STEP, REC_JOB_OVERHEAD,
                                    REC_JOB_CATEGORY_LEAK, REC_RANK_HOURS, REC_JOB_HOURS)
#: labels a job x module series keeps
MODULE = (*JOB, "module", "phase")
#: every recorded series and the labels it keeps (dashboards read these for fleet-wide panels)
RECORDED_LABELS: dict[str, tuple[str, ...]] = {
    REC_RANK_PEAK: RANK, REC_JOB_PEAK_MAX: JOB, REC_JOB_PEAK_MIN: JOB, REC_JOB_RANK_SKEW: JOB,
    REC_RANK_DEVICE_PEAK: (*RANK, "device"), REC_DEVICE_RATIO: (*RANK, "device"),
    REC_JOB_CATEGORY_PEAK: (*JOB, "category"),
    REC_JOB_CATEGORY_PEAK_MIN: (*JOB, "category"), REC_JOB_CATEGORY_CURRENT: (*JOB, "category"),
    REC_JOB_MODULE_PEAK: MODULE, REC_JOB_MODULE_PEAK_RANK: (*MODULE, "rank"), REC_JOB_MODULE_SKEW: MODULE,
    REC_JOB_MODULE_FORWARD: (*JOB, "module"), REC_JOB_RANKS: JOB, REC_JOB_STALE: JOB, REC_JOB_OOMS: JOB,
    REC_JOB_RETRIES: JOB, REC_JOB_ERRORS: (*JOB, "component"), REC_JOB_HEADROOM: JOB, REC_JOB_RESIDENT: JOB,
    REC_JOB_DEVICE_RATIO: JOB, REC_JOB_RESERVED_PEAK: JOB, REC_JOB_PEAK_GAP: JOB, REC_JOB_LAST_STEP: JOB,
    REC_JOB_OVERHEAD: JOB,
    REC_JOB_CATEGORY_LEAK: (*JOB, "category"), REC_RANK_HOURS: (*RANK, "device"), REC_JOB_HOURS: JOB,
}

_DURATION_RE = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


@dataclass(frozen=True)
class RuleConfig:
    """Alert thresholds. Durations are Prometheus durations ("30m", "1h", "1d")."""

    #: FsdpMemStepPeakRegression: the job's step peak over the last ``regression_window`` is more
    #: than this many percent above its step peak over the same window ``regression_offset`` earlier
    regression_percent: float = 10.0
    regression_window: str = "30m"
    regression_offset: str = "1h"
    regression_for: str = "15m"
    #: FsdpMemNearDeviceCapacity: step peak / device total above this (CUDA only)
    capacity_ratio: float = 0.92
    capacity_for: str = "10m"
    #: FsdpMemAllocRetries: cudaMalloc retries within this window, sustained for ``retries_for``
    retries_window: str = "10m"
    retries_for: str = "10m"
    #: FsdpMemOOM: an allocator OOM within this window
    oom_window: str = "10m"
    #: FsdpMemRankImbalance: (max - min) / max of the ranks' step peaks above this many percent
    imbalance_percent: float = 20.0
    imbalance_for: str = "15m"
    #: FsdpMemAboveEstimate: a rank's step peak above its estimate (fsdp-mem-otel estimate) by
    #: more than this many percent
    estimate_margin_percent: float = 10.0
    estimate_for: str = "10m"
    #: FsdpMemTrainingStalled: no step closed for this long (the rank's process is alive)
    stalled_after: str = "15m"
    stalled_for: str = "5m"
    #: FsdpMemRankDown: the sidecar flags the rank's file stale for this long
    rank_down_for: str = "5m"
    #: FsdpMemRankLost / FsdpMemJobRanksLost: a rank the sidecar served within ``lost_window`` has
    #: had no sample for ``lost_after`` and recorded no clean end, for ``lost_for``. The window is
    #: how long the rules remember a rank (the alert resolves by itself that long after the loss).
    lost_window: str = "1h"
    lost_after: str = "2m"
    lost_for: str = "3m"
    #: FsdpMemTrackerErrors / FsdpMemSidecarReadErrors: errors within this window
    errors_window: str = "15m"
    errors_for: str = "5m"
    #: FsdpMemLeak: the tracker reported a category growing by more than this many bytes per step
    #: (fsdp_mem_leak_growth_bytes_per_step) within the last ``leak_lookback`` (which bridges the
    #: steps where its detector paused), for ``leak_for``
    leak_min_bytes_per_step: float = 1024.0
    leak_lookback: str = "2m"
    leak_for: str = "10m"
    #: FsdpMemCapacityForecast and the hours-to-capacity recording rules: fitted over
    #: ``forecast_window`` (growing in both its halves), a rank's step peak or step-end bytes reach
    #: its CUDA device's capacity within ``forecast_hours``, for ``forecast_for``
    forecast_window: str = "1h"
    forecast_hours: float = 6.0
    forecast_for: str = "15m"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "str" or isinstance(value, str):
                if not isinstance(value, str) or not _DURATION_RE.match(value):
                    raise ValueError(f"{f.name} must be a Prometheus duration like '30m' or '1h'; got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{f.name} must be a positive number; got {value!r}")
        if not self.capacity_ratio < 1.5:
            raise ValueError(f"capacity_ratio is a ratio (e.g. 0.92); got {self.capacity_ratio!r}")
        if not self.imbalance_percent < 100:
            raise ValueError(f"imbalance_percent must be below 100; got {self.imbalance_percent!r}")
        if not float(_seconds(self.forecast_window)) >= 2:
            raise ValueError(f"forecast_window must be 2s or longer; got {self.forecast_window!r}")


def _by(labels: Sequence[str]) -> str:
    return ", ".join(labels)


def _num(x: float) -> str:
    return f"{x:g}"


def _exact(x: float) -> str:
    """``x`` without rounding (a byte count: 1048576, not 1.04858e+06)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


#: the allocator's peaks of the step that ``device_peak_expression`` weighs against the tracked one
ALLOCATOR_PEAKS: tuple[cat.Metric, ...] = (cat.ALLOCATED_PEAK_BYTES, cat.ACTIVE_PEAK_BYTES, cat.RESERVED_PEAK_BYTES)


def device_peak_expression() -> str:
    """Per rank x CUDA device: the largest of the tracked step peak (category total) and the
    allocator's allocated, active and reserved peaks of the step. On CUDA an OOM is decided by the
    allocator: a cudaMalloc fails when reserved memory cannot grow, and the tracked peak leaves out
    what no tracked tensor holds (the allocator's cache and fragmentation, cuBLAS workspaces, and op
    temporaries where the tracker does not reset the allocator's peaks). Each source is labelled
    (``peak``) so that ``or`` keeps them all; a rank without allocator peaks (older trackers) keeps
    its tracked one."""
    per = _by((*RANK, "device"))
    parts = [(f'{cat.STEP_PEAK_BYTES.name}{{category="total",device=~"cuda.*"}}', "tracked")]
    parts += [(f'{m.name}{{device=~"cuda.*"}}', m.source.removesuffix("_peak_bytes")) for m in ALLOCATOR_PEAKS]
    body = "or\n".join(f'label_replace(\n  max by ({per}) ({s}),\n  "peak", "{name}", "", ""\n)\n'
                       for s, name in parts)
    return f"max by ({per}) (\n{_indent(body)})\n"


def recording_rules(cfg: RuleConfig | None = None) -> list[dict[str, Any]]:
    """Recording rules: cheap per-rank / per-job step peaks, rank skew, device capacity used, and
    the fleet's pre-aggregation: per job x category and per job x module (max over ranks, the
    rank holding it, the ranks' skew), so that fleet panels read one series per job or module
    instead of one per rank; leak growth per job x category; hours to device capacity per rank
    and per job (``forecast_expression``)."""
    c = cfg or RuleConfig()
    peak_total = cat.selector(cat.STEP_PEAK_BYTES, category="total")
    device_total = cat.selector(cat.DEVICE_TOTAL_BYTES)
    module_peak = cat.MODULE_PEAK_BYTES.name
    return [
        {"record": REC_RANK_PEAK, "expr": f"max by ({_by(RANK)}) ({peak_total})"},
        {"record": REC_JOB_PEAK_MAX, "expr": f"max by ({_by(JOB)}) ({REC_RANK_PEAK})"},
        {"record": REC_JOB_PEAK_MIN, "expr": f"min by ({_by(JOB)}) ({REC_RANK_PEAK})"},
        {
            "record": REC_JOB_RANK_SKEW,
            "expr": f"({REC_JOB_PEAK_MAX} - {REC_JOB_PEAK_MIN})\n/ ({REC_JOB_PEAK_MAX} > 0)\n",
        },
        {"record": REC_RANK_DEVICE_PEAK, "expr": device_peak_expression()},
        {
            "record": REC_DEVICE_RATIO,
            "expr": (
                f'{REC_RANK_DEVICE_PEAK}\n'
                f'/ on ({_by((*RANK, "device"))})\n'
                f'max by ({_by((*RANK, "device"))}) ({device_total} > 0)\n'
            ),
        },
        {"record": REC_JOB_CATEGORY_PEAK, "expr": f"max by ({_by((*JOB, 'category'))}) ({cat.STEP_PEAK_BYTES.name})"},
        {"record": REC_JOB_MODULE_PEAK, "expr": f"max by ({_by(MODULE)}) ({module_peak})"},
        {
            "record": REC_JOB_MODULE_PEAK_RANK,
            "expr": f"max by ({_by((*MODULE, 'rank'))}) (topk by ({_by(MODULE)}) (1, {module_peak}))",
        },
        {
            "record": REC_JOB_MODULE_SKEW,
            "expr": (f"(\n  {REC_JOB_MODULE_PEAK}\n  - min by ({_by(MODULE)}) ({module_peak})\n)\n"
                     f"/ ({REC_JOB_MODULE_PEAK} > 0)\n"),
        },
        *_job_rules(),
        {"record": REC_JOB_CATEGORY_LEAK,
         "expr": f"max by ({_by((*JOB, 'category'))}) ({cat.LEAK_GROWTH.name})"},
        {"record": REC_RANK_HOURS, "expr": forecast_expression(c)},
        {"record": REC_JOB_HOURS, "expr": f"min by ({_by(JOB)}) ({REC_RANK_HOURS})"},
    ]


def forecast_expression(c: RuleConfig) -> str:
    """Per rank x CUDA device: in how many hours the device peak (``REC_RANK_DEVICE_PEAK``: the
    largest of the tracked step peak and the allocator's peaks of the step), or the step-end bytes,
    reach the device's capacity (``fsdp_mem_device_total_bytes``), the sooner of the two.

    For each series ``s``: the least-squares line over ``forecast_window``
    (``predict_linear(s[w], 0)``, where it stands now, and ``deriv(s[w])``, its slope) meets the
    capacity after ``(capacity - predict_linear(s[w], 0)) / deriv(s[w])`` seconds (0 once past it).
    Only steady growth counts: ``s`` grew over the window and over each of its halves, and it was
    already there a whole window ago. So a jump (the optimizer state created at step 1, a restart)
    gives no series (it lies in one half only), nor does a warm-up shorter than half a window that
    levelled off, and a job younger than the window has none yet. No capacity (CPU ranks, a rank
    that stopped reporting) or no growth: no series."""
    w, half = c.forecast_window, _half(c.forecast_window)
    per = _by((*RANK, "device"))
    on = f"on ({per})"
    capacity = f"max by ({per}) ({cat.selector(cat.DEVICE_TOTAL_BYTES)} > 0)"

    def one(s: str, series: str) -> str:
        hours = (f"clamp_min(\n  (\n    {capacity}\n    - {on}\n"
                 f"    max by ({per}) (predict_linear({s}[{w}], 0))\n  )\n"
                 f"  / {on}\n  (max by ({per}) (deriv({s}[{w}])) > 0)\n  / 3600,\n  0\n)\n")
        steady = (f"and {on}\nmax by ({per}) (deriv({s}[{half}])) > 0\n"
                  f"and {on}\nmax by ({per}) (deriv({s}[{half}] offset {half})) > 0\n"
                  f"and {on}\nmax by ({per}) ({s} offset {w})\n")
        return f'label_replace(\n{_indent(hours + steady)}  , "series", "{series}", "", ""\n)\n'

    step_end = f'{cat.CURRENT_BYTES.name}{{category="total",device=~"cuda.*"}}'
    return (f"min by ({per}) (\n{_indent(one(REC_RANK_DEVICE_PEAK, 'peak'))}or\n"
            f"{_indent(one(step_end, 'step_end'))})\n")


def leak_expression(c: RuleConfig) -> str:
    """Per rank x category: the tracker's leak growth (bytes per step) at its largest over the last
    ``leak_lookback``, above ``leak_min_bytes_per_step``. The gauge exists only while the tracker's
    detector calls the category growing, so the lookback bridges the steps where it paused. A
    rank's ``total`` counts only when none of its categories does (it grows with them)."""
    growth = cat.LEAK_GROWTH.name
    per = _by((*RANK, "category"))

    def part(matcher: str) -> str:
        return (f"max by ({per}) (max_over_time({growth}{{{matcher}}}[{c.leak_lookback}]))\n"
                f"> {_exact(c.leak_min_bytes_per_step)}\n")

    return part('category!="total"') + f"or on ({_by(RANK)})\n" + part('category="total"')


def _per_rank(metric: str, *by: str) -> str:
    """``metric`` once per rank (and ``by``): a rank scraped directly and through the sidecar counts once."""
    return f"max by ({_by((*RANK, *by))}) ({metric})"


def _job_rules() -> list[dict[str, Any]]:
    """Per job (x category, module or component): what the fleet overview and the job drill-down's
    all-rank panels read, one series per job instead of one per rank."""
    peak = cat.STEP_PEAK_BYTES.name
    cuda_peak = f'{peak}{{category="total",device=~"cuda.*"}}'
    reserved_peak = f'{cat.RESERVED_PEAK_BYTES.name}{{device=~"cuda.*"}}'
    device_total = cat.selector(cat.DEVICE_TOTAL_BYTES)
    per_rank_overhead = (f"{_per_rank(cat.OVERHEAD_SECONDS.name)}\n/ on ({_by(RANK)})\n"
                         f"({_per_rank(cat.STEP_DURATION_SECONDS.name)} > 0)")
    return [
        {"record": REC_JOB_CATEGORY_PEAK_MIN, "expr": f"min by ({_by((*JOB, 'category'))}) "
                                                      f"({_per_rank(peak, 'category')})"},
        {"record": REC_JOB_CATEGORY_CURRENT, "expr": f"sum by ({_by((*JOB, 'category'))}) "
                                                     f"({_per_rank(cat.CURRENT_BYTES.name, 'category')})"},
        {"record": REC_JOB_MODULE_FORWARD, "expr": f"max by ({_by((*JOB, 'module'))}) "
                                                   f"({cat.MODULE_FORWARD_SECONDS.name})"},
        {"record": REC_JOB_RANKS, "expr": f"count by ({_by(JOB)}) ({_per_rank(cat.TRACKER_INFO.name)})"},
        {"record": REC_JOB_STALE, "expr": f"sum by ({_by(JOB)}) ({_per_rank(cat.SIDECAR_RANK_STALE.name)})"},
        {"record": REC_JOB_OOMS, "expr": f"sum by ({_by(JOB)}) ({_per_rank(cat.OOMS_TOTAL.name, 'device')})"},
        {"record": REC_JOB_RETRIES,
         "expr": f"sum by ({_by(JOB)}) ({_per_rank(cat.ALLOC_RETRIES_TOTAL.name, 'device')})"},
        {"record": REC_JOB_ERRORS, "expr": f"sum by ({_by((*JOB, 'component'))}) "
                                           f"({_per_rank(cat.ERRORS_TOTAL.name, 'component')})"},
        {"record": REC_JOB_HEADROOM,
         "expr": (f"min by ({_by(JOB)}) (\n  {_per_rank(device_total, 'device')}\n  - on ({_by(RANK)}, device)\n"
                  f"  {REC_RANK_DEVICE_PEAK}\n)\n")},
        {"record": REC_JOB_RESIDENT, "expr": f"max by ({_by(JOB)}) ({cat.RESIDENT_BYTES.name})"},
        {"record": REC_JOB_DEVICE_RATIO, "expr": f"max by ({_by(JOB)}) ({REC_DEVICE_RATIO})"},
        {"record": REC_JOB_RESERVED_PEAK, "expr": f"max by ({_by(JOB)}) ({reserved_peak})"},
        {"record": REC_JOB_PEAK_GAP,
         "expr": (f"max by ({_by(JOB)}) (\n  {_per_rank(reserved_peak, 'device')}\n  - on ({_by(RANK)}, device)\n"
                  f"  {_per_rank(cuda_peak, 'device')}\n)\n")},
        {"record": REC_JOB_LAST_STEP,
         "expr": f"min by ({_by(JOB)}) ({_per_rank(cat.LAST_STEP_TIMESTAMP_SECONDS.name)})"},
        {"record": REC_JOB_OVERHEAD, "expr": f"max by ({_by(JOB)}) (\n{per_rank_overhead}\n)\n"},
    ]


def _alert(name: str, expr: str, for_: str | None, severity: str, summary: str, description: str,
           runbook: str) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if for_:
        rule["for"] = for_
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {"summary": summary, "description": description, "runbook": runbook}
    return rule


def alert_rules(cfg: RuleConfig | None = None) -> list[dict[str, Any]]:
    """Alert rules; see docs/operations.md's alert table for what each means and what to do."""
    c = cfg or RuleConfig()
    job = "{{ $labels.namespace }}/{{ $labels.job_name }}"
    rank = job + " rank {{ $labels.rank }}"
    win, off = c.regression_window, c.regression_offset
    reg = 1 + c.regression_percent / 100
    return [
        _alert(
            "FsdpMemStepPeakRegression",
            f"max_over_time({REC_JOB_PEAK_MAX}[{win}])\n"
            f"/ (max_over_time({REC_JOB_PEAK_MAX}[{win}] offset {off}) > 0)\n"
            f"> {_num(reg)}\n",
            c.regression_for, "warning",
            f"FSDP step peak memory of {job} grew",
            f"The largest step peak of {job} over the last {win} is {{{{ $value | humanizePercentage }}}} "
            f"of its largest step peak over the {win} that ended {off} earlier (threshold "
            f"{_num(c.regression_percent)}% growth).",
            "Open the job's dashboard and find the category (fsdp_mem_step_peak_bytes by category) and the "
            "modules (fsdp_mem_module_peak_bytes) that grew. Steady growth within one run is a leak (tensors "
            "kept across steps: losses or outputs appended to a list, a growing cache); a jump after a "
            "restart is a change in model, batch size, sequence length or FSDP settings. Compare with "
            "the previous run's JSONL report.",
        ),
        _alert(
            "FsdpMemNearDeviceCapacity",
            f"{REC_DEVICE_RATIO} > {_num(c.capacity_ratio)}\n",
            c.capacity_for, "warning",
            f"Memory peak of {rank} near device capacity",
            f"The memory peak of {rank} on {{{{ $labels.device }}}} (the largest of the tracked step peak and "
            f"the allocator's peaks of the step) uses {{{{ $value | humanizePercentage }}}} of the device's "
            f"memory (threshold {_num(c.capacity_ratio * 100)}%). An OOM is one larger batch or sequence away.",
            "Compare the tracked step peak (fsdp_mem_step_peak_bytes, by category) with the allocator's "
            "(fsdp_mem_allocator_reserved_peak_bytes; the allocator correlation dashboard shows both and the "
            "gap). The categories say what to shrink: reduce micro-batch size or sequence length, enable "
            "activation checkpointing, reshard_after_forward=True, or CPU offload of optimizer state. A large "
            "gap is the allocator's cache and fragmentation (fsdp_mem_allocator_fragmentation_ratio): set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
        ),
        _alert(
            "FsdpMemLeak",
            leak_expression(c),
            c.leak_for, "warning",
            f"{{{{ $labels.category }}}} memory of {rank} grows every step",
            f"The tracker of {rank} reports its {{{{ $labels.category }}}} bytes at the step end growing by "
            f"{{{{ $value | humanize1024 }}}}B per step (they never fell and rose at half of its last steps or "
            f"more; threshold {_exact(c.leak_min_bytes_per_step)} bytes per step), for over {c.leak_for}: "
            "tensors outlive the step they were made in, and the rank runs out of memory in the end.",
            "fsdp_mem_step_end_held_bytes (job drill-down, Leaks row) names the FSDP modules whose saved "
            "tensors, inputs or outputs are still alive after the optimizer step. Usual cause: something keeps "
            "a tensor and its autograd graph across steps: losses or outputs appended to a list for logging "
            "(keep loss.item() or loss.detach()), inputs kept for later, a cache keyed by step, "
            "backward(retain_graph=True). FsdpMemCapacityForecast and the hours-to-capacity panels say when "
            "the device fills.",
        ),
        _alert(
            "FsdpMemCapacityForecast",
            f"{REC_RANK_HOURS} < {_num(c.forecast_hours)}\n",
            c.forecast_for, "warning",
            f"{rank} reaches its device's capacity within {_num(c.forecast_hours)}h",
            f"The memory peak (tracked or allocator's, the larger) or step-end bytes of {rank} on "
            f"{{{{ $labels.device }}}} have grown steadily over the last {c.forecast_window}; at that rate they "
            f"reach the device's memory in {{{{ $value | printf \"%.1f\" }}}} hours "
            f"(threshold {_num(c.forecast_hours)}h).",
            "A steady growth of a training job's memory is a leak: see FsdpMemLeak and the job drill-down's "
            "Leaks row (fsdp_mem_leak_growth_bytes_per_step by category, fsdp_mem_step_end_held_bytes by "
            "module). Fix it, or checkpoint and restart before the forecast runs out. Growth that levels off "
            "by itself (a warm-up longer than half the forecast window, a cache that fills) only needs a longer "
            "--forecast-window.",
        ),
        _alert(
            "FsdpMemAllocRetries",
            f"sum by ({_by((*RANK, 'device'))}) (increase({cat.ALLOC_RETRIES_TOTAL.name}[{c.retries_window}]))"
            " > 0\n",
            c.retries_for, "warning",
            f"CUDA allocator of {rank} keeps retrying allocations",
            f"{rank} on {{{{ $labels.device }}}} had {{{{ $value | humanize }}}} cudaMalloc retries in the last "
            f"{c.retries_window}, for over {c.retries_for}: the caching allocator runs out of memory, frees its "
            "cache and retries, which stalls every step.",
            "The job is at the edge of device memory; see FsdpMemNearDeviceCapacity. Lower the peak (smaller "
            "micro-batch, activation checkpointing) or reduce fragmentation "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). Step times "
            "(fsdp_mem_step_duration_seconds) show the cost.",
        ),
        _alert(
            "FsdpMemOOM",
            f"sum by ({_by((*RANK, 'device'))}) (increase({cat.OOMS_TOTAL.name}[{c.oom_window}])) > 0\n"
            f"or\nsum by ({_by((*RANK, 'device'))}) (\n  {cat.OOMS_TOTAL.name} > 0\n  unless "
            f"{cat.OOMS_TOTAL.name} offset {c.oom_window}\n)\n",
            None, "critical",
            f"CUDA out-of-memory on {rank}",
            f"The device allocator of {rank} on {{{{ $labels.device }}}} raised out-of-memory errors in the "
            f"last {c.oom_window}.",
            "Look at the last steps' peaks before the OOM (fsdp_mem_step_peak_bytes by category, "
            "fsdp_mem_module_peak_bytes by module) to find what grew. Usual fixes: smaller micro-batch or "
            "sequence length, activation checkpointing, reshard_after_forward=True, optimizer state offload. "
            "If the job restarted, make sure it did not resume with a larger batch.",
        ),
        _alert(
            "FsdpMemRankImbalance",
            f"{REC_JOB_RANK_SKEW} > {_num(c.imbalance_percent / 100)}\n",
            c.imbalance_for, "warning",
            f"FSDP step peaks differ across the ranks of {job}",
            f"The smallest step peak of {job}'s ranks is {{{{ $value | humanizePercentage }}}} below the largest "
            f"(threshold {_num(c.imbalance_percent)}%). The largest rank OOMs first.",
            "Find the outlier rank (namespace_job_name_rank:fsdp_mem_step_peak_bytes:max). Typical causes: "
            "uneven data (variable sequence lengths without packing), rank-0-only work (logging, evaluation, "
            "checkpoint gathering with full_state_dict), an uneven wrapping policy, or a different device or "
            "allocator setting on one node.",
        ),
        _alert(
            "FsdpMemAboveEstimate",
            f"{REC_RANK_PEAK}\n"
            f"/ on ({_by(RANK)})\n"
            f"(max by ({_by(RANK)}) ({cat.selector(cat.ESTIMATE_STEP_PEAK_BYTES, category='total')}) > 0)\n"
            f"> {_num(1 + c.estimate_margin_percent / 100)}\n",
            c.estimate_for, "warning",
            f"FSDP step peak of {rank} is above its estimate",
            f"The step peak of {rank} is {{{{ $value | humanizePercentage }}}} of the estimate it was launched "
            f"with (threshold {_num(c.estimate_margin_percent)}% above). Only jobs launched with "
            "FSDP_MEM_OTEL_ESTIMATE are evaluated.",
            "Compare the run with its estimate: `fsdp-mem-otel compare ESTIMATE.jsonl RUN.jsonl` names the "
            "categories and modules that grew. The estimate does not see NCCL and cuBLAS workspaces, allocator "
            "fragmentation or the CUDA context; a real gap in activations usually means a different batch, "
            "sequence length or checkpointing than the estimate assumed.",
        ),
        _alert(
            "FsdpMemTrainingStalled",
            f"time() - max by ({_by(RANK)}) ({cat.LAST_STEP_TIMESTAMP_SECONDS.name}) > "
            f"{_seconds(c.stalled_after)}\n"
            f"unless on ({_by(RANK)})\n"
            f"{_per_rank(cat.RANK_END_TIMESTAMP_SECONDS.name)}\n",
            c.stalled_for, "warning",
            f"{rank} closed no training step for {c.stalled_after}",
            f"{rank} last closed a step {{{{ $value | humanizeDuration }}}} ago. Its metrics are still "
            "scraped, so the process is alive but not stepping: a hang (e.g. a collective waiting on a dead "
            "or slow peer), a long checkpoint or evaluation, or tracker.step() no longer called.",
            "Check the rank's logs and the other ranks: if all ranks stalled together, look for a collective "
            "hang (py-spy dump, NCCL_DEBUG=INFO, TORCH_NCCL_ASYNC_ERROR_HANDLING); if one rank is "
            "stalled, look at its node. Raise stalled_after if checkpoints legitimately take longer.",
        ),
        _alert(
            "FsdpMemRankDown",
            f"max by ({_by(RANK)}) ({cat.SIDECAR_RANK_STALE.name}) == 1\n",
            c.rank_down_for, "critical",
            f"{rank} stopped writing its metrics",
            "The fsdp-mem-otel sidecar of {{ $labels.namespace }}/{{ $labels.job_name }} has had no "
            "update of rank {{ $labels.rank }}'s metrics file for longer than its --stale-seconds: the "
            "rank's process died or hangs with its exporter (the exporter refreshes the file between steps "
            "while the process lives).",
            "Check the training container's status and logs (exit code, OOMKilled, NCCL errors) and the "
            "node. A dead rank usually takes the whole job down with it; if the job keeps running, the "
            "other ranks are blocked in a collective.",
        ),
        *_lost_alerts(c),
        _alert(
            "FsdpMemTrackerErrors",
            f"sum by ({_by((*RANK, 'component'))}) (increase({cat.ERRORS_TOTAL.name}[{c.errors_window}])) > 0\n",
            c.errors_for, "info",
            f"fsdp-mem-otel {{{{ $labels.component }}}} errors on {rank}",
            f"The fsdp-mem-otel {{{{ $labels.component }}}} of {rank} counted {{{{ $value | humanize }}}} "
            f"internal errors in the last {c.errors_window}. Training is unaffected, but its memory metrics "
            "may be incomplete; the tracker detaches itself after max_errors (default 100).",
            "Read the fsdp_mem_otel logger's output in the training container (each kind of failure is "
            "logged once). component=exporter: the sidecar directory or the metrics port; "
            "component=tracker: report a bug with the log line and the torch version.",
        ),
        _alert(
            "FsdpMemSidecarReadErrors",
            f"sum by (namespace, pod, rank) (increase({cat.SIDECAR_READ_ERRORS_TOTAL.name}[{c.errors_window}])) > 0\n",
            c.errors_for, "info",
            "fsdp-mem-otel sidecar of {{ $labels.namespace }}/{{ $labels.pod }} cannot read rank files",
            f"The fsdp-mem-otel sidecar of pod {{{{ $labels.namespace }}}}/{{{{ $labels.pod }}}} could not read or "
            f"parse rank {{{{ $labels.rank }}}}'s metrics file "
            f"{{{{ $value | humanize }}}} times in the last {c.errors_window}; that rank's samples are left out.",
            "Read the sidecar container's log. Usual causes: the training and sidecar containers run as "
            "different users (the rank files are mode 0644 in the shared emptyDir), or a different "
            "fsdp-mem-otel version in the two images.",
        ),
    ]


def lost_expressions(c: RuleConfig) -> dict[str, str]:
    """The PromQL pieces of the lost-rank alerts, per rank (namespace, job_name, rank):

    - ``seen``: served by a sidecar within ``lost_window`` (with the ``node`` of its tracker_info);
    - ``alive``: a sample within ``lost_after``;
    - ``clean``: a clean end recorded within ``lost_window``, and no step closed after it (a later
      run under the same job name that is lost in turn is not covered by the earlier clean end);
    - ``lost``: seen, not alive, not clean.

    Ranks scraped only on their own port are left out: their end cannot outlive their process."""
    w, a = c.lost_window, c.lost_after
    info, end = cat.TRACKER_INFO.name, cat.RANK_END_TIMESTAMP_SECONDS.name
    on = f"on ({_by(RANK)})"
    clean_end = f'max by ({_by(RANK)}) (max_over_time({end}{{reason="{cat.END_CLEAN}"}}[{w}]))'
    seen = (f"max by ({_by((*RANK, 'node'))}) (max_over_time({info}[{w}]))\n"
            f"and {on}\n"
            f"max by ({_by(RANK)}) (max_over_time({cat.SIDECAR_RANK_LAST_UPDATE.name}[{w}]))\n")
    alive = f"max by ({_by(RANK)}) (present_over_time({info}[{a}]))\n"
    clean = (f"{clean_end}\nunless {on}\n"
             f"(\n  max by ({_by(RANK)}) (max_over_time({cat.LAST_STEP_TIMESTAMP_SECONDS.name}[{w}]))\n"
             f"  > {on}\n  {clean_end}\n)\n")
    lost = f"(\n{_indent(seen)})\nunless {on}\n{alive}unless {on}\n(\n{_indent(clean)})\n"
    return {"seen": seen, "alive": alive, "clean": clean, "lost": lost}


def _lost_alerts(c: RuleConfig) -> list[dict[str, Any]]:
    job = "{{ $labels.namespace }}/{{ $labels.job_name }}"
    rank = job + " rank {{ $labels.rank }}"
    lost = lost_expressions(c)["lost"]
    return [
        _alert(
            "FsdpMemRankLost",
            lost,
            c.lost_for, "critical",
            f"{rank} on node {{{{ $labels.node }}}} is gone without a clean end",
            f"No metrics of {rank} (node {{{{ $labels.node }}}}) for {c.lost_after} or more, and it recorded no "
            "clean end: its node, pod or sidecar was lost, its process was killed, or it ended by SIGTERM "
            "(preemption) or an error.",
            "Check the node (kubectl get node, its conditions and events), the pod's events and exit codes, and "
            "the rank's last values (fsdp_mem_step_peak_bytes, fsdp_mem_last_oom_*: an OOM kill leaves no end). "
            f'fsdp_mem_rank_end_timestamp_seconds{{reason="{cat.END_SIGTERM}"}} means it was preempted or '
            f'evicted, reason="{cat.END_ERROR}" that it failed; no end at all, that the process or node '
            f'vanished. A rank that finished normally records reason="{cat.END_CLEAN}" and never raises this; '
            "ranks scraped only on their own port (no sidecar) are not covered.",
        ),
        _alert(
            "FsdpMemJobRanksLost",
            f"count by ({_by(JOB)}) (group by ({_by(RANK)}) (\n{_indent(lost)}))\n",
            c.lost_for, "warning",
            f"{job} lost ranks without a clean end",
            f"{{{{ $value }}}} of the ranks {job} had within the last {c.lost_window} are gone without a clean "
            f"end (no metrics for {c.lost_after}): its rank count fell below its recent maximum. "
            "FsdpMemRankLost names each rank and its node.",
            "Find the node(s) in FsdpMemRankLost. The surviving ranks usually hang in a collective until its "
            "timeout: restart the job from its last checkpoint once the node is replaced or cordoned.",
        ),
    ]


def _half(duration: str) -> str:
    """Half of a Prometheus duration, in seconds (or milliseconds)."""
    ms = round(float(_seconds(duration)) * 1000) // 2
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def _indent(text: str) -> str:
    return "".join("  " + line + "\n" for line in text.splitlines())


def _seconds(duration: str) -> str:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    total = 0.0
    for value, unit in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", duration):
        total += int(value) * units[unit]
    return _num(total)


def rule_groups(cfg: RuleConfig | None = None) -> list[dict[str, Any]]:
    """The ``groups`` of a Prometheus rules file (recording rules first: alerts read them)."""
    return [
        {"name": "fsdp-mem-otel.recording", "rules": recording_rules(cfg)},
        {"name": "fsdp-mem-otel.alerts", "rules": alert_rules(cfg)},
    ]


def prometheus_rule(cfg: RuleConfig | None = None) -> dict[str, Any]:
    """The same groups as a prometheus-operator PrometheusRule (monitoring.coreos.com/v1)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "fsdp-mem-otel",
            "labels": {
                "app.kubernetes.io/name": "fsdp-mem-otel",
                "app.kubernetes.io/component": "alerting",
                # match your Prometheus's ruleSelector (kube-prometheus-stack: release=<helm release>)
                "release": "kube-prometheus-stack",
            },
        },
        "spec": {"groups": rule_groups(cfg)},
    }
