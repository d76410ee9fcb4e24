"""Grafana dashboards as code: ``dashboards/*.json`` built from ``catalog.py`` with grafana-foundation-sdk.

Three dashboards, all on one Prometheus data source chosen by the ``datasource`` variable:

- **Fleet overview** (``fleet-overview.json``): every job; step peak per job (largest and
  smallest rank); the tracked step peak beside the allocator's reserved peak and the gap between
  them; headroom to device capacity and the share of it used, from the device peak (the larger of
  the tracked and the allocator's peaks: what runs out); OOMs and allocator retries; jobs whose step peak
  grew against an earlier window; leak growth per job and category, and hours until each job's
  first rank fills its device at its steady growth (``alerts.forecast_expression``); tracker
  health. Every panel reads the recording rules' per-job series (``alerts.recording_rules``), so
  its cost does not grow with a job's ranks or modules.
- **Job drill-down** (``job-drilldown.json``): one job; step peak by category and per-module
  forward/backward peaks over all ranks (recorded job x category and job x module series: the
  largest rank, the rank holding it, the skew); the tracked and allocator peaks and their gap; per-rank
  series for the panels drawn per rank; a
  rank's own categories and modules for the ranks picked in ``$inspect`` (no All); rank skew;
  step-over-step trend; leaks (growth per category, bytes held at the step end per module, hours
  to device capacity per rank).
- **Allocator correlation** (``allocator-correlation.json``): a row per rank picked in ``$rank``
  (no All), what the tracker counts next to what the device allocator reports (allocated,
  reserved, their peaks and the gap to the tracked peak, untracked, fragmentation, retries, the
  device peak's share of capacity), with the FSDP categories on the same time axis.

Fleet budget: at 1,024 ranks x 100 modules no query reads more than 10,000 series
(tests/dashboards/test_fleet_prometheus.py measures it on a real Prometheus).

Every metric name comes from ``catalog`` (``Metric.name``), and every label a query matches on is
checked against the metric's catalog labels when the dashboards are built, so a rename in the
catalog either flows through or fails the build.

Queries that only CUDA devices can answer (allocator statistics, hours to device capacity) are built
with ``Query(cuda_only=True)``; ``Dashboard.cuda_only`` lists them, and the live-Prometheus test allows
exactly those to return nothing on a CPU-only run. Likewise ``Query(leak_only=True)``
(``Dashboard.leak_only``): the leak series, which the tracker exports only while a category grows
or a module holds tensors at the step end, so a healthy job leaves them empty. Where a CPU run has
a meaningful stand-in (host resident bytes instead of device headroom), the query falls back with
PromQL ``or`` instead.

Series are deduplicated per rank (``max by (... rank ...)``) before any sum, so a rank scraped
both directly and through the sidecar (``fsdp-mem-otel serve``) is not counted twice.

Output is stable: sorted keys, fixed uids and panel ids, no timestamps. Regenerate with
``fsdp-mem-otel dashboards --out dashboards/`` (``--check`` fails when the files differ).

Needs ``grafana-foundation-sdk==1769699379!11.6.0`` (the Grafana 11.6 build; a bare install
resolves to an older 10.1 build, whose package carries a higher version epoch).
"""

from __future__ import annotations

import json
import re
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_mem_otel.cli_errors import ArgumentParser
from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.fleet.alerts import (
    REC_DEVICE_RATIO,
    REC_JOB_CATEGORY_CURRENT,
    REC_JOB_CATEGORY_LEAK,
    REC_JOB_CATEGORY_PEAK,
    REC_JOB_CATEGORY_PEAK_MIN,
    REC_JOB_DEVICE_RATIO,
    REC_JOB_ERRORS,
    REC_JOB_HEADROOM,
    REC_JOB_HOURS,
    REC_JOB_LAST_STEP,
    REC_JOB_MODULE_FORWARD,
    REC_JOB_MODULE_PEAK,
    REC_JOB_MODULE_SKEW,
    REC_JOB_OOMS,
    REC_JOB_OVERHEAD,
    REC_JOB_PEAK_GAP,
    REC_JOB_PEAK_MAX,
    REC_JOB_PEAK_MIN,
    REC_JOB_RANK_SKEW,
    REC_JOB_RANKS,
    REC_JOB_RESERVED_PEAK,
    REC_JOB_RESIDENT,
    REC_JOB_RETRIES,
    REC_JOB_STALE,
    REC_RANK_HOURS,
    RECORDED_LABELS,
)

#: the grafana-foundation-sdk build these dashboards are generated with (Grafana 11.6 types)
SDK_REQUIREMENT = "grafana-foundation-sdk==1769699379!11.6.0"
#: the data source variable every panel and target points at (``${datasource}``)
DATASOURCE_VAR = "datasource"
#: tag on every dashboard; the dashboards link to each other through it
TAG = "fsdp-mem-otel"

# -- PromQL building blocks ----------------------------------------------------------------------
#: group-by keys: one series per rank, per job
RANK_KEY = "namespace, job_name, pod, rank"
JOB_KEY = "namespace, job_name"
#: the labels of the recorded per-rank and per-job series
_RANK = "namespace, job_name, rank"
_JOB = JOB_KEY

Matcher = tuple[str, str, str]  # (label, op, value)


@dataclass(frozen=True)
class Scope:
    """The variable matchers a dashboard's queries carry (``job_name="$job"`` or ``=~"$job"``)."""

    multi_job: bool
    module: bool = False
    #: the variable that picks the ranks: ``rank`` (All allowed) or ``inspect`` (a few ranks)
    rank_var: str = "rank"

    def ids(self) -> tuple[Matcher, ...]:
        return (
            ("namespace", "=~", "$namespace"),
            ("job_name", "=~" if self.multi_job else "=", "$job"),
            ("pod", "=~", "$pod"),
            ("rank", "=~", f"${self.rank_var}"),
        )


def sel(m: cat.Metric, scope: Scope | None = None, *extra: Matcher, **eq: str) -> str:
    """Selector for catalog metric ``m`` with the scope's variable matchers, ``extra`` matchers and
    ``label="value"`` equalities; every label must be one the metric carries."""
    allowed = set(m.all_labels) | set(cat.IDENTITY_LABELS) | set(cat.OPTIONAL_IDENTITY_LABELS)
    matchers: list[Matcher] = list(scope.ids()) if scope is not None else []
    if scope is not None and scope.module and "module" in m.labels:
        matchers.append(("module", "=~", "$module"))
    matchers += list(extra)
    matchers += [(k, "=", v) for k, v in eq.items()]
    for label, op, _ in matchers:
        if label not in allowed:
            raise ValueError(f"{m.name} has no label {label!r}; it has {sorted(allowed)}")
        if op not in ("=", "!=", "=~", "!~"):
            raise ValueError(f"unknown matcher operator {op!r}")
    if not matchers:
        return m.name
    return m.name + "{" + ", ".join(f'{label}{op}"{value}"' for label, op, value in matchers) + "}"


def recorded(name: str, *matchers: Matcher) -> str:
    """Selector for a recorded series (``alerts.RECORDED_LABELS``): fleet-wide panels read these,
    one series per job or job x module, instead of one per rank."""
    for label, _, _ in matchers:
        if label not in RECORDED_LABELS[name]:
            raise ValueError(f"{name} has no label {label!r}; it has {list(RECORDED_LABELS[name])}")
    return name + "{" + ", ".join(f'{label}{op}"{value}"' for label, op, value in matchers) + "}"


def total(m: cat.Metric, scope: Scope) -> str:
    """``m`` restricted to ``category="total"``."""
    return sel(m, scope, category="total")


def categories(m: cat.Metric, scope: Scope) -> str:
    """``m`` without the ``total`` category (the parts that stack up to it)."""
    return sel(m, scope, ("category", "!=", "total"))


@dataclass(frozen=True)
class Query:
    """One panel target. ``cuda_only``: returns nothing unless a rank reports a CUDA device;
    ``leak_only``: returns nothing unless a rank leaks (its tracker reports a category growing or
    tensors held at the step end)."""

    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False
    cuda_only: bool = False
    leak_only: bool = False


@dataclass(frozen=True)
class Dashboard:
    """A generated dashboard: file name, uid, JSON object and the CUDA-only targets."""

    file_name: str
    uid: str
    title: str
    json: dict[str, Any]
    #: (panel title, refId) of every target that only CUDA devices answer
    cuda_only: frozenset[tuple[str, str]]
    #: (panel title, refId) of every target that only a leaking job answers
    leak_only: frozenset[tuple[str, str]] = frozenset()

    def render(self) -> str:
        return json.dumps(self.json, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


# -- SDK glue --------------------------------------------------------------------------------------
def _sdk() -> Any:
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"building the dashboards needs grafana-foundation-sdk: pip install '{SDK_REQUIREMENT}'"
        ) from exc
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import heatmap, stat, table, timeseries
    from grafana_foundation_sdk.builders import prometheus as pb
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import dashboard as dm
    from grafana_foundation_sdk.models import heatmap as hm
    from grafana_foundation_sdk.models import prometheus as pm

    return types.SimpleNamespace(cb=cb, db=db, heatmap=heatmap, stat=stat, table=table, timeseries=timeseries, pb=pb,
                                 JSONEncoder=JSONEncoder, cm=cm, dm=dm, hm=hm, pm=pm)


class _Board:
    """A dashboard builder that numbers panels, assigns refIds and records CUDA-only targets."""

    def __init__(self, sdk: Any, uid: str, title: str, description: str, file_name: str) -> None:
        self.sdk = sdk
        self.uid, self.title, self.file_name = uid, title, file_name
        dm, db = sdk.dm, sdk.db
        self.ds = dm.DataSourceRef(type_val="prometheus", uid="${" + DATASOURCE_VAR + "}")
        self.b = (
            db.Dashboard(title).uid(uid).description(description).tags([TAG, "fsdp", "memory"])
            .time("now-3h", "now").refresh("30s").timezone("browser").editable()
            .tooltip(dm.DashboardCursorSync.CROSSHAIR)
            .link(db.DashboardLink("FSDP memory dashboards").type(dm.DashboardLinkType.DASHBOARDS).tags([TAG])
                  .as_dropdown(True).include_vars(True).keep_time(True))
        )
        self._next_id = 1
        self._titles: set[str] = set()
        self.cuda_only: set[tuple[str, str]] = set()
        self.leak_only: set[tuple[str, str]] = set()

    def _id(self) -> int:
        n = self._next_id
        self._next_id += 1
        return n

    def variable(self, v: Any) -> None:
        self.b.with_variable(v)

    def row(self, title: str, repeat: str | None = None) -> None:
        r = self.sdk.db.Row(title).id(self._id())
        if repeat:
            r.repeat(repeat)
        self.b.with_row(r)

    def add(self, panel: Any, title: str, description: str, queries: Sequence[Query], w: int, h: int) -> None:
        if title in self._titles:
            raise ValueError(f"{self.uid}: duplicate panel title {title!r}")
        self._titles.add(title)
        cuda = [q for q in queries if q.cuda_only]
        if len(cuda) == len(queries):
            description = f"{description} CUDA only: no data on CPU-only jobs."
        elif cuda:
            names = ", ".join(re.sub(r"\s*\{\{\w+\}\}", "", q.legend).strip() for q in cuda)
            description = f"{description} CUDA only (no data on CPU-only jobs): {names}."
        if any(q.leak_only for q in queries):
            description = (f"{description} Empty while nothing leaks: the tracker exports these series only "
                           "while a category grows or tensors outlive the step.")
        panel.id(self._id()).title(title).description(description).datasource(self.ds).span(w).height(h)
        for i, q in enumerate(queries):
            ref = chr(ord("A") + i)
            t = self.sdk.pb.Dataquery().expr(q.expr).ref_id(ref).datasource(self.ds)
            if q.instant:
                t.instant()
            else:
                t.range()
            if q.legend:
                t.legend_format(q.legend)
            if q.table:
                t.format(self.sdk.pm.PromQueryFormat.TABLE)
            panel.with_target(t)
            if q.cuda_only:
                self.cuda_only.add((title, ref))
            if q.leak_only:
                self.leak_only.add((title, ref))
        self.b.with_panel(panel)

    def build(self) -> Dashboard:
        model = self.b.build()
        interval = "interval"
        for v in (model.templating.list_val or []) if model.templating is not None else []:
            if v.type_val != interval:  # the SDK writes interval-only fields on every variable
                v.auto = v.auto_min = v.auto_count = None
        obj = json.loads(json.dumps(model, cls=self.sdk.JSONEncoder))
        return Dashboard(self.file_name, self.uid, self.title, obj, frozenset(self.cuda_only),
                         frozenset(self.leak_only))


# -- panels ------------------------------------------------------------------------------------------
def _legend(sdk: Any, table: bool = False) -> Any:
    cb, cm = sdk.cb, sdk.cm
    legend = cb.VizLegendOptions().show_legend(True)
    if table:
        return legend.display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.RIGHT).calcs(
            ["lastNotNull", "max"]).sort_by("Max").sort_desc(True)
    return legend.display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM)


def _thresholds(sdk: Any, *steps: tuple[float | None, str]) -> Any:
    dm = sdk.dm
    return sdk.db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in steps])


def timeseries(sdk: Any, unit: str, *, stack: bool = False, legend_table: bool = False, min0: bool = True) -> Any:
    cm = sdk.cm
    p = (sdk.timeseries.Panel().unit(unit).legend(_legend(sdk, legend_table))
         .tooltip(sdk.cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
         .line_width(1).fill_opacity(25 if stack else 10).show_points(cm.VisibilityMode.NEVER)
         .span_nulls(False))
    if min0:
        p.min(0)
    if stack:
        p.stacking(sdk.cb.StackingConfig().mode(cm.StackingMode.NORMAL))
    return p


def stat(sdk: Any, unit: str, *, red_at: float | None = None, no_value: str = "") -> Any:
    cm = sdk.cm
    p = (sdk.stat.Panel().unit(unit).reduce_options(sdk.cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
         .graph_mode(cm.BigValueGraphMode.NONE).color_mode(cm.BigValueColorMode.VALUE))
    if red_at is not None:
        p.thresholds(_thresholds(sdk, (None, "green"), (red_at, "red")))
    if no_value:
        p.no_value(no_value)
    return p


def table(sdk: Any, unit: str, *, sort: str = "", desc: bool = True,
          transformations: Sequence[tuple[str, dict[str, Any]]] = (), gradient: bool = False,
          thresholds: Any = None) -> Any:
    cm, dm = sdk.cm, sdk.dm
    p = sdk.table.Panel().unit(unit)
    if sort:
        p.sort_by([sdk.cb.TableSortByFieldState().display_name(sort).desc(desc)])
    for tid, options in transformations:
        p.with_transformation(dm.DataTransformerConfig(id_val=tid, options=options))
    if gradient:
        p.cell_options(cm.TableColoredBackgroundCellOptions(mode=cm.TableCellBackgroundDisplayMode.GRADIENT))
        p.color_scheme(sdk.db.FieldColor().mode(dm.FieldColorModeId.CONTINUOUS_GR_YL_RD))
    if thresholds is not None:
        p.thresholds(thresholds)
        p.cell_options(cm.TableColoredBackgroundCellOptions(mode=cm.TableCellBackgroundDisplayMode.BASIC))
        p.color_scheme(sdk.db.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
    return p


def heatmap(sdk: Any, unit: str) -> Any:
    cm = sdk.cm
    hm = sdk.heatmap
    return (hm.Panel().unit(unit).calculate(False).cell_values(hm.CellValues().unit(unit))
            .color(hm.HeatmapColorOptions().mode(sdk.hm.HeatmapColorMode.SCHEME).scheme("Oranges").steps(64).exponent(0.5)
                   .reverse(False).fill("dark-orange"))
            .y_axis(hm.YAxisConfig().axis_placement(cm.AxisPlacement.LEFT).reverse(False))
            .show_value(cm.VisibilityMode.NEVER).cell_gap(1))


def _hide_time() -> tuple[str, dict[str, Any]]:
    return ("organize", {"excludeByName": {"Time": True}})


def _matrix(row: str, column: str) -> tuple[str, dict[str, Any]]:
    return ("groupingToMatrix", {"rowField": row, "columnField": column, "valueField": "Value", "emptyValue": "null"})


# -- variables ---------------------------------------------------------------------------------------
def _variables(board: _Board, *, multi_job: bool, module: bool = False, baseline: bool = False,
               ranks: bool = True, rank_all: bool = True, inspect: bool = False) -> None:
    """The dashboard's variables. ``ranks``: $pod and $rank (with All unless ``rank_all`` is
    False: panels repeated per rank must not repeat over a thousand of them); ``inspect``: a
    multi-valued rank picker without All, for the panels that read one rank's modules or categories."""
    sdk = board.sdk
    db, dm = sdk.db, sdk.dm
    board.variable(db.DatasourceVariable(DATASOURCE_VAR).label("Data source").type("prometheus"))
    info = cat.TRACKER_INFO

    def query_var(name: str, label: str, expr: str, *, multi: bool = True, numeric: bool = False,
                  include_all: bool = True) -> Any:
        v = (db.QueryVariable(name).label(label).datasource(board.ds).query(expr)
             .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
             .sort(dm.VariableSort.NUMERICAL_ASC if numeric else dm.VariableSort.ALPHABETICAL_ASC))
        if multi:
            v.multi(True)
            if include_all:
                v.include_all(True).all_value(".*")
        return v

    job_op = "=~" if multi_job else "="
    ns = ("namespace", "=~", "$namespace")
    job = ("job_name", job_op, "$job")
    pod = ("pod", "=~", "$pod")
    board.variable(query_var("namespace", "Namespace", f"label_values({sel(info)}, namespace)"))
    board.variable(query_var("job", "Job", f"label_values({sel(info, None, ns)}, job_name)", multi=multi_job))
    rank_values = f"label_values({sel(info, None, ns, job, pod)}, rank)"
    if ranks:
        board.variable(query_var("pod", "Pod", f"label_values({sel(info, None, ns, job)}, pod)"))
        board.variable(query_var("rank", "Rank", rank_values, numeric=True, include_all=rank_all))
    if inspect:
        board.variable(query_var("inspect", "Inspect ranks", rank_values, numeric=True, include_all=False)
                       .description("Ranks whose categories and modules are drawn one by one (no All: a "
                                    "thousand-rank job would draw a thousand panels)."))
    if module:  # from the job x module recorded series: one per module and phase, not per rank
        board.variable(query_var("module", "Module", f"label_values({recorded(REC_JOB_MODULE_PEAK, ns, job)}, module)"))
    if baseline:
        board.variable(
            db.CustomVariable("baseline").label("Compare with").values("1h,6h,1d,7d")
            .current(dm.VariableOption(text="1d", value="1d", selected=True))
            .description("Regression baseline: the largest step peak in the window of this length that ended "
                         "this long ago.")
        )


# -- the dashboards ----------------------------------------------------------------------------------
def fleet_overview(sdk: Any) -> Dashboard:
    b = _Board(sdk, "fsdp-mem-fleet", "FSDP memory: fleet overview",
               "Every FSDP job that runs fsdp_mem_otel: step peaks, headroom, OOMs, regressions, tracker health.",
               "fleet-overview.json")
    # every panel reads the recording rules' per-job series: one per job (x component), whatever
    # the job's size, so the fleet's cost does not grow with its ranks or modules
    _variables(b, multi_job=True, baseline=True, ranks=False)
    jobs = (("namespace", "=~", "$namespace"), ("job_name", "=~", "$job"))

    def job(name: str) -> str:
        return recorded(name, *jobs)

    job_peak = job(REC_JOB_PEAK_MAX)

    b.row("Fleet")
    b.add(stat(sdk, "short"), "Jobs reporting", "Jobs with at least one rank exporting now.",
          [Query(f"count({job(REC_JOB_RANKS)})", instant=True)], 4, 4)
    b.add(stat(sdk, "short"), "Ranks reporting", "Ranks exporting now, over the selected jobs.",
          [Query(f"sum({job(REC_JOB_RANKS)})", instant=True)], 4, 4)
    b.add(stat(sdk, "short", red_at=1, no_value="no sidecar"), "Stale ranks (sidecar)",
          "Ranks whose sidecar file stopped changing (process gone). Needs `fsdp-mem-otel serve`.",
          [Query(f"sum({job(REC_JOB_STALE)})", instant=True)], 4, 4)
    b.add(stat(sdk, "short", red_at=1), "OOMs in range", "Out-of-memory errors raised by the device allocator.",
          [Query(f"sum(increase({job(REC_JOB_OOMS)}[$__range]))", instant=True, cuda_only=True)], 4, 4)
    b.add(stat(sdk, "short", red_at=1), "Allocator retries in range",
          "cudaMalloc failures that flushed the allocator cache and retried: a step away from OOM, and slow.",
          [Query(f"sum(increase({job(REC_JOB_RETRIES)}[$__range]))", instant=True, cuda_only=True)], 4, 4)
    b.add(stat(sdk, "bytes"), "Largest step peak", "Largest tracked step peak over the selected jobs' ranks now.",
          [Query(f"max({job_peak})", instant=True)], 4, 4)

    b.row("Step peak")
    b.add(timeseries(sdk, "bytes", legend_table=True), "Step peak per job (largest and smallest rank)",
          "Tracked bytes at the step peak (all categories) of each job's largest and smallest rank; the job "
          "drill-down has every rank.",
          [Query(f"max by ({_JOB}) ({job_peak})", "{{job_name}} largest rank"),
           Query(f"max by ({_JOB}) ({job(REC_JOB_PEAK_MIN)})", "{{job_name}} smallest rank")], 16, 9)
    b.add(table(sdk, "bytes", sort="Value", transformations=[_hide_time()]), "Step peak per job (largest rank)",
          "The largest rank's step peak of each job, now.",
          [Query(f"max by ({_JOB}) ({job_peak})", instant=True, table=True)], 8, 9)
    headroom = (
        f'label_replace({job(REC_JOB_HEADROOM)}, "measure", "headroom to device capacity (lowest rank)", "", "")'
        f' or label_replace({job(REC_JOB_RESIDENT)} unless on ({_JOB}) {job(REC_JOB_HEADROOM)}, '
        f'"measure", "host resident (no device capacity reported)", "", "")'
    )
    b.add(table(sdk, "bytes", sort="Value", desc=False, transformations=[_hide_time()]),
          "Headroom to device capacity (lowest first)",
          "Per job, the smallest device capacity minus the device peak over its ranks' devices (the larger of "
          "the tracked step peak and the allocator's peaks of the step: what runs out). Jobs that report no "
          "device capacity (CPU-only) show their largest host resident bytes instead, named in the measure "
          "column.",
          [Query(headroom, instant=True, table=True)], 12, 8)
    b.add(timeseries(sdk, "percentunit"), "Memory peak as share of device capacity",
          "The device peak (the larger of the tracked step peak and the allocator's allocated, active and "
          "reserved peaks of the step) over the device's total memory, largest over each job's ranks: what "
          "FsdpMemNearDeviceCapacity reads.",
          [Query(f"max by ({_JOB}) ({job(REC_JOB_DEVICE_RATIO)})", "{{job_name}}", cuda_only=True)], 12, 8)
    b.add(timeseries(sdk, "bytes", legend_table=True), "Tracked vs allocator peak per job (largest rank)",
          "Per job: the largest rank's tracked step peak, the largest allocator reserved peak of the step over "
          "its ranks' devices, and the largest gap between the two on one device (reserved peak - tracked "
          "step peak: the allocator's cache and fragmentation, workspaces, and what no tracked tensor held). "
          "On CUDA the allocator's is what runs out.",
          [Query(f"max by ({_JOB}) ({job_peak})", "{{job_name}} tracked step peak"),
           Query(f"max by ({_JOB}) ({job(REC_JOB_RESERVED_PEAK)})", "{{job_name}} allocator reserved peak",
                 cuda_only=True),
           Query(f"max by ({_JOB}) ({job(REC_JOB_PEAK_GAP)})", "{{job_name}} gap", cuda_only=True)], 24, 8)

    b.row("Regressions")
    earlier = f"max_over_time({job_peak}[$baseline] offset $baseline)"
    b.add(table(sdk, "percentunit", sort="Value", transformations=[_hide_time()],
                thresholds=_thresholds(sdk, (None, "green"), (0.02, "yellow"), (0.05, "red"))),
          "Step peak change vs earlier window (regressions first)",
          "Largest step peak now over the largest step peak in the $baseline window that ended $baseline ago, "
          "minus 1. Red: grew by more than 5%.",
          [Query(f"max by ({_JOB}) ({job_peak}) / max by ({_JOB}) ({earlier}) - 1", instant=True, table=True)],
          12, 8)
    b.add(timeseries(sdk, "bytes"), "Step peak now and $baseline earlier",
          "Each job's largest step peak, and the same series shifted by $baseline.",
          [Query(f"max by ({_JOB}) ({job_peak})", "{{job_name}}"),
           Query(f"max by ({_JOB}) ({job_peak} offset $baseline)", "{{job_name}} ($baseline earlier)")], 12, 8)

    b.row("Leaks and capacity forecast")
    b.add(timeseries(sdk, "bytes"), "Leak growth per job and category (bytes per step)",
          "Bytes per step by which a category's live bytes at the step end grow, on the job's fastest-growing "
          "rank (the tracker's leak detector: they never fell and rose at half of its last steps or more). "
          "FsdpMemLeak fires when it lasts; the job drill-down names the modules holding the bytes.",
          [Query(f"max by ({_JOB}, category) ({job(REC_JOB_CATEGORY_LEAK)})", "{{job_name}} {{category}}",
                 leak_only=True)], 12, 8)
    b.add(table(sdk, "h", sort="Value", desc=False, transformations=[_hide_time()],
                thresholds=_thresholds(sdk, (None, "red"), (6, "yellow"), (24, "green"))),
          "Hours to device capacity per job (soonest first)",
          "At the steady growth of its device peak (tracked or allocator's, the larger) or step-end bytes over "
          "the rules' forecast window (1h by "
          "default: growing over the window and each of its halves), hours until the job's first rank reaches "
          "its device's memory (0: past it). Jobs whose memory does not grow steadily are not listed. "
          "FsdpMemCapacityForecast fires below 6h by default.",
          [Query(f"min by ({_JOB}) ({job(REC_JOB_HOURS)})", instant=True, table=True, cuda_only=True)], 12, 8)

    b.row("Allocator and tracker health")
    b.add(timeseries(sdk, "short"), "OOMs and allocator retries per job",
          "Increase per interval, summed over the job's ranks.",
          [Query(f"sum by ({_JOB}) (increase({job(REC_JOB_OOMS)}[$__rate_interval]))", "{{job_name}} OOMs",
                 cuda_only=True),
           Query(f"sum by ({_JOB}) (increase({job(REC_JOB_RETRIES)}[$__rate_interval]))", "{{job_name}} retries",
                 cuda_only=True)], 6, 8)
    b.add(timeseries(sdk, "s"), "Seconds since the job's slowest rank stepped",
          "Grows while a rank is stuck (e.g. in a collective with a dead peer); the job drill-down shows which.",
          [Query(f"time() - max by ({_JOB}) ({job(REC_JOB_LAST_STEP)})", "{{job_name}}")], 6, 8)
    b.add(timeseries(sdk, "percentunit"), "Tracker overhead (share of step time, largest rank)",
          "Time in the tracker's module-state hooks and deferred accounting over the step's wall-clock time, last "
          "step, largest over the job's ranks: a lower bound (its FSDP group and saved-tensor hooks are not timed).",
          [Query(f"max by ({_JOB}) ({job(REC_JOB_OVERHEAD)})", "{{job_name}}")], 6, 8)
    b.add(timeseries(sdk, "short"), "Tracker and exporter errors",
          "Internal failures per interval, summed over the job's ranks (never raised into training).",
          [Query(f"sum by ({_JOB}, component) (increase({recorded(REC_JOB_ERRORS, *jobs)}[$__rate_interval]))",
                 "{{job_name}} {{component}}")], 6, 8)
    return b.build()


def job_drilldown(sdk: Any) -> Dashboard:
    s = Scope(multi_job=False, module=True)
    b = _Board(sdk, "fsdp-mem-job", "FSDP memory: job drill-down",
               "One FSDP job: where each rank's step peak goes, per category and per module; rank skew; trend.",
               "job-drilldown.json")
    # panels over every rank read one series per rank at most, or the job-level recorded series;
    # a rank's categories and modules are drawn for the ranks picked in $inspect
    _variables(b, multi_job=False, module=True, inspect=True)
    one = Scope(multi_job=False, module=True, rank_var="inspect")
    peak = total(cat.STEP_PEAK_BYTES, s)
    mod = cat.MODULE_PEAK_BYTES
    job_of = (("namespace", "=~", "$namespace"), ("job_name", "=", "$job"))

    def job(name: str, *extra: Matcher) -> str:
        return recorded(name, *job_of, *extra)

    def module_recorded(name: str, *extra: Matcher) -> str:
        return job(name, ("module", "=~", "$module"), *extra)

    b.row("Step peak by category")
    rank_panel = timeseries(sdk, "bytes", stack=True).repeat("inspect").repeat_direction("h").max_per_row(4)
    b.add(rank_panel, "Rank $inspect: step peak by category",
          "Bytes per category at the moment of the rank's step peak, stacked (the stack is the step peak). "
          "One panel per rank picked in Inspect ranks.",
          [Query(f"max by (rank, category) ({categories(cat.STEP_PEAK_BYTES, one)})", "{{category}}")], 24, 9)
    b.add(table(sdk, "bytes", sort="Value", transformations=[_hide_time()]), "Step peak by category (largest rank)",
          "Last step: per category, the largest rank's bytes at its step peak (recorded series; $pod and $rank "
          "do not apply).",
          [Query(f"max by (category) ({job(REC_JOB_CATEGORY_PEAK)})", instant=True, table=True)], 24, 7)
    b.add(timeseries(sdk, "bytes"), "Tracked vs allocator peak (largest rank)",
          "The largest rank's tracked step peak, the largest allocator reserved peak of the step over the "
          "job's devices, and the largest gap between the two on one device (recorded series; $pod and $rank "
          "do not apply). The allocator correlation dashboard has them per rank.",
          [Query(f"max({job(REC_JOB_PEAK_MAX)})", "tracked step peak"),
           Query(f"max({job(REC_JOB_RESERVED_PEAK)})", "allocator reserved peak", cuda_only=True),
           Query(f"max({job(REC_JOB_PEAK_GAP)})", "gap (reserved peak - tracked)", cuda_only=True)], 24, 8)

    b.row("Modules")
    b.add(table(sdk, "bytes", transformations=[_matrix("module", "phase")]),
          "Module peak, forward and backward (largest rank)",
          "Peak total bytes during each module's forward and backward in the last step, largest over the "
          "job's ranks (recorded series, so $pod and $rank do not apply).",
          [Query(f"max by (module, phase) ({module_recorded(REC_JOB_MODULE_PEAK)})", instant=True, table=True)],
          12, 10)
    b.add(table(sdk, "bytes", transformations=[_matrix("module", "rank")], gradient=True),
          "Module x inspected rank backward peak",
          "Last step's backward peak per module (rows) and rank picked in Inspect ranks (columns); colour marks "
          "the heavy cells. The rank holding each module's peak over all ranks: the table on the left.",
          [Query(f"max by (module, rank) ({sel(mod, one, phase='backward')})", instant=True, table=True)], 12, 10)
    for phase in cat.PHASES:
        b.add(heatmap(sdk, "bytes"), f"Module {phase} peak over time (largest rank)",
              f"One row per module; colour is the {phase} peak bytes of the rank with the largest (recorded "
              "series).",
              [Query(f"max by (module) ({module_recorded(REC_JOB_MODULE_PEAK, ('phase', '=', phase))})",
                     "{{module}}")], 12, 10)
    b.add(timeseries(sdk, "s"), "Module forward time (slowest rank)",
          "Wall-clock time of each module's forward in the last step, summed over its calls, on the slowest "
          "rank (recorded series).",
          [Query(f"max by (module) ({job(REC_JOB_MODULE_FORWARD, ('module', '=~', '$module'))})", "{{module}}")],
          24, 8)

    b.row("Estimate vs measured")
    b.add(timeseries(sdk, "bytes"), "Step peak vs estimate",
          "Each rank's step peak beside the estimate it was launched with (FSDP_MEM_OTEL_ESTIMATE, from "
          "`fsdp-mem-otel estimate`); FsdpMemAboveEstimate fires when the measurement exceeds it by the "
          "configured margin. Empty for jobs launched without an estimate.",
          [Query(f"max by (rank) ({peak})", "rank {{rank}} measured"),
           Query(f"max by (rank) ({total(cat.ESTIMATE_STEP_PEAK_BYTES, s)})", "rank {{rank}} estimate")], 24, 8)

    b.row("Rank skew")
    b.add(timeseries(sdk, "bytes"), "Rank skew of step peak (max - min across ranks)",
          "Spread of the step peak over the ranks, in total and per category. Large skew: uneven sharding, "
          "uneven inputs, or one rank holding extra state.",
          [Query(f"max({job(REC_JOB_PEAK_MAX)}) - min({job(REC_JOB_PEAK_MIN)})", "total"),
           Query(f"max by (category) ({job(REC_JOB_CATEGORY_PEAK, ('category', '!=', 'total'))}) - "
                 f"min by (category) ({job(REC_JOB_CATEGORY_PEAK_MIN, ('category', '!=', 'total'))})",
                 "{{category}}")], 12, 8)
    b.add(timeseries(sdk, "percentunit"), "Rank skew relative to the largest rank",
          "(max - min) / max of the step peak over the ranks (recorded series).",
          [Query(f"max({job(REC_JOB_RANK_SKEW)})", "skew")], 6, 8)
    b.add(table(sdk, "percentunit", sort="Value", transformations=[_hide_time()]), "Module skew across ranks",
          "Per module and phase: (largest - smallest rank's peak) / largest, last step, over the job's ranks "
          "(recorded series).",
          [Query(f"max by (module, phase) ({module_recorded(REC_JOB_MODULE_SKEW)})", instant=True, table=True)],
          6, 8)

    b.row("Leaks")
    b.add(timeseries(sdk, "bytes"), "Leak growth per category (fastest rank)",
          "Bytes per step by which the category's live bytes at the step end grow, on the job's fastest-growing "
          "rank (the tracker's leak detector; recorded series, so $pod and $rank do not apply).",
          [Query(f"max by (category) ({job(REC_JOB_CATEGORY_LEAK)})", "{{category}}", leak_only=True)], 8, 8)
    b.add(timeseries(sdk, "bytes"), "Bytes held at step end per module (largest rank)",
          "Bytes that each FSDP module's saved tensors, inputs and outputs still hold after the optimizer step "
          "(light mode; a healthy step frees them), the 3 largest holders per rank: what a leak keeps alive.",
          [Query(f"max by (module) ({sel(cat.STEP_END_HELD_BYTES, s)})", "{{module}}", leak_only=True)], 8, 8)
    b.add(table(sdk, "h", sort="Value", desc=False, transformations=[_hide_time()],
                thresholds=_thresholds(sdk, (None, "red"), (6, "yellow"), (24, "green"))),
          "Hours to device capacity per rank (soonest first)",
          "Per rank and CUDA device: hours until its device peak or step-end bytes reach the device's memory at "
          "their steady growth over the rules' forecast window (0: past it). Ranks whose memory does not grow "
          "steadily are not listed.",
          [Query(f"min by (rank, device) ({job(REC_RANK_HOURS, ('rank', '=~', '$rank'))})", instant=True,
                 table=True, cuda_only=True)], 8, 8)

    b.row("Step-over-step trend")
    b.add(timeseries(sdk, "bytes", min0=False), "Step peak change per step",
          "Growth of the step peak per training step (derivative over time divided by steps per second). "
          "A lasting positive value means the peak keeps growing: a leak or a growing cache.",
          [Query(f"max by (rank) (deriv({peak}[$__rate_interval])) / on (rank) "
                 f"max by (rank) (rate({sel(cat.STEPS_TOTAL, s)}[$__rate_interval]))", "r{{rank}}")], 12, 8)
    b.add(timeseries(sdk, "bytes", stack=True), "Live bytes at step end by category (sum over ranks)",
          "What stays allocated between steps; it should be flat once the optimizer state exists.",
          [Query(f"max by (category) ({job(REC_JOB_CATEGORY_CURRENT, ('category', '!=', 'total'))})",
                 "{{category}}")], 12, 8)
    b.add(timeseries(sdk, "s"), "Step duration per rank", "Wall-clock time between two tracker.step() calls.",
          [Query(f"max by (rank) ({sel(cat.STEP_DURATION_SECONDS, s)})", "r{{rank}}")], 12, 8)
    b.add(timeseries(sdk, "bytes"), "Step peak per rank", "Tracked bytes at each rank's step peak.",
          [Query(f"max by (rank) ({peak})", "r{{rank}}")], 12, 8)
    return b.build()


def allocator_correlation(sdk: Any) -> Dashboard:
    s = Scope(multi_job=False)
    b = _Board(sdk, "fsdp-mem-allocator", "FSDP memory: allocator correlation",
               "Per rank: what the tracker attributes next to what the device allocator holds, with the FSDP "
               "categories on the same time axis.", "allocator-correlation.json")
    # a row per rank: $rank has no All, so that a thousand-rank job does not draw a thousand rows
    _variables(b, multi_job=False, rank_all=False)
    key = "rank, device"

    b.row("Rank $rank", repeat="rank")
    b.add(timeseries(sdk, "bytes", legend_table=True), "Tracked vs allocator",
          "Tracked live bytes at step end and at the step peak, next to the allocator's allocated and reserved "
          "bytes (current and peak) and the process's host resident bytes.",
          [Query(f"max by ({key}) ({total(cat.CURRENT_BYTES, s)})", "tracked live, step end {{device}}"),
           Query(f"max by ({key}) ({total(cat.STEP_PEAK_BYTES, s)})", "tracked step peak {{device}}"),
           Query(f"max by ({key}) ({sel(cat.ALLOCATED_BYTES, s)})", "allocated {{device}}", cuda_only=True),
           Query(f"max by ({key}) ({sel(cat.RESERVED_BYTES, s)})", "reserved {{device}}", cuda_only=True),
           Query(f"max by ({key}) ({sel(cat.ALLOCATED_PEAK_BYTES, s)})", "allocated peak {{device}}",
                 cuda_only=True),
           Query(f"max by ({key}) ({sel(cat.RESERVED_PEAK_BYTES, s)})", "reserved peak {{device}}", cuda_only=True),
           Query(f"max by ({key}) ({sel(cat.RESIDENT_BYTES, s)})", "host resident ({{device}})")], 12, 9)
    b.add(timeseries(sdk, "bytes", stack=True), "FSDP categories at step peak",
          "Bytes per category at the step peak, stacked (the stack is the tracked step peak).",
          [Query(f"max by (rank, category) ({categories(cat.STEP_PEAK_BYTES, s)})", "{{category}}")], 12, 9)
    b.add(timeseries(sdk, "bytes", min0=False), "Untracked bytes (allocated - tracked)",
          "Allocated bytes the tracker did not attribute to a category. Negative: the tracker counts memory "
          "the allocator did not hand out.",
          [Query(f"max by ({key}) ({sel(cat.UNTRACKED_BYTES, s)})", "untracked {{device}}", cuda_only=True)], 6, 8)
    b.add(timeseries(sdk, "bytes"), "Device memory outside PyTorch (used - reserved)",
          "What the device has in use beyond the caching allocator's reservation: the CUDA context, NCCL "
          "buffers, cuBLAS/cuDNN workspaces (and other processes on a shared GPU). Not in any tracker category.",
          [Query(f"max by ({key}) ({sel(cat.OUTSIDE_PYTORCH_BYTES, s)})", "outside PyTorch {{device}}",
                 cuda_only=True)], 6, 8)
    b.add(timeseries(sdk, "percentunit"), "Fragmentation (1 - allocated / reserved)",
          "Share of reserved bytes not handed out to tensors at step end.",
          [Query(f"max by ({key}) ({sel(cat.FRAGMENTATION_RATIO, s)})", "{{device}}", cuda_only=True)], 6, 8)
    b.add(timeseries(sdk, "bytes"), "Cached and split bytes",
          "Reserved minus allocated (the allocator's cache) and inactive split blocks (fragmentation).",
          [Query(f"max by ({key}) ({sel(cat.RESERVED_BYTES, s)}) - on ({key}) "
                 f"max by ({key}) ({sel(cat.ALLOCATED_BYTES, s)})", "cached, not allocated {{device}}",
                 cuda_only=True),
           Query(f"max by ({key}) ({sel(cat.INACTIVE_SPLIT_BYTES, s)})", "inactive split {{device}}",
                 cuda_only=True)], 6, 8)
    b.add(timeseries(sdk, "short"), "Allocator retries and OOMs",
          "Increase per interval of cudaMalloc retries and out-of-memory errors.",
          [Query(f"max by ({key}) (increase({sel(cat.ALLOC_RETRIES_TOTAL, s)}[$__rate_interval]))",
                 "retries {{device}}", cuda_only=True),
           Query(f"max by ({key}) (increase({sel(cat.OOMS_TOTAL, s)}[$__rate_interval]))", "OOMs {{device}}",
                 cuda_only=True)], 6, 8)
    b.add(timeseries(sdk, "bytes", min0=False), "Allocator peak - tracked step peak",
          "Per device: the allocator's reserved and allocated peaks of the step minus the tracked step peak. "
          "Where the tracker resets the allocator's peaks (the default on CUDA) the tracked peak includes op "
          "temporaries, and the allocated gap is what was allocated before the step's first module (workspaces, "
          "untracked tensors); the reserved gap adds the allocator's cache and fragmentation.",
          [Query(f"max by ({key}) ({sel(cat.RESERVED_PEAK_BYTES, s)}) - on ({key}) "
                 f"max by ({key}) ({total(cat.STEP_PEAK_BYTES, s)})", "reserved peak gap {{device}}", cuda_only=True),
           Query(f"max by ({key}) ({sel(cat.ALLOCATED_PEAK_BYTES, s)}) - on ({key}) "
                 f"max by ({key}) ({total(cat.STEP_PEAK_BYTES, s)})", "allocated peak gap {{device}}",
                 cuda_only=True)], 9, 8)
    ratio = recorded(REC_DEVICE_RATIO, ("namespace", "=~", "$namespace"), ("job_name", "=", "$job"),
                     ("rank", "=~", "$rank"))
    b.add(timeseries(sdk, "percentunit"), "Memory peak as share of device capacity",
          "The device peak (the larger of the tracked step peak and the allocator's peaks of the step) over "
          "the device's total memory: what FsdpMemNearDeviceCapacity reads (recorded series).",
          [Query(f"max by ({key}) ({ratio})", "{{device}}", cuda_only=True)], 9, 8)
    return b.build()


def build_dashboards() -> list[Dashboard]:
    """Every dashboard, built fresh."""
    sdk = _sdk()
    return [fleet_overview(sdk), job_drilldown(sdk), allocator_correlation(sdk)]


def write_dashboards(out_dir: str | Path) -> list[Path]:
    """Write every dashboard's JSON into ``out_dir`` (created if missing); returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in build_dashboards():
        path = out / d.file_name
        path.write_text(d.render(), encoding="utf-8")
        paths.append(path)
    return paths


def check_dashboards(out_dir: str | Path) -> list[str]:
    """File names in ``out_dir`` that differ from a fresh build (missing ones included)."""
    out = Path(out_dir)
    stale = []
    for d in build_dashboards():
        path = out / d.file_name
        if not path.is_file() or path.read_text(encoding="utf-8") != d.render():
            stale.append(d.file_name)
    return stale


def dashboards_main(argv: Sequence[str] | None = None) -> int:
    """``fsdp-mem-otel dashboards --out DIR [--check]``."""
    p = ArgumentParser(prog="fsdp-mem-otel dashboards",
                                description="Generate the Grafana dashboards (JSON) from the metric catalog.")
    p.add_argument("--out", default="dashboards", help="directory to write the JSON into (default: dashboards)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the files in --out differ from a fresh build")
    args = p.parse_args(argv)
    from fsdp_mem_otel.cli_errors import check_writable, write_failed

    if not args.check:
        check_writable(args.out, "--out", directory=True)
    try:
        if args.check:
            stale = check_dashboards(args.out)
            for name in stale:
                print(f"fsdp-mem-otel dashboards: {Path(args.out) / name} is out of date", file=sys.stderr)
            return 1 if stale else 0
        for path in write_dashboards(args.out):
            print(path)
    except ImportError as exc:
        print(f"fsdp-mem-otel dashboards: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        raise write_failed(getattr(exc, "filename", None) or args.out, "--out", exc) from exc
    return 0


if __name__ == "__main__":
    import sys

    from fsdp_mem_otel.cli_errors import run_command

    raise SystemExit(run_command("fsdp-mem-otel dashboards", dashboards_main, sys.argv[1:]))
