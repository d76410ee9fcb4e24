"""Every metric this project exports: name, type, unit, help and labels. Standard library only.

The Prometheus exporter, the sidecar server, the dashboards and the alert rules all read this
file, so a rename happens here and nowhere else.

Conventions: one prefix (``fsdp_mem_``), base units as name suffixes (``_bytes``, ``_seconds``,
``_ratio``), counters end in ``_total``. Every series of a rank also carries the identity labels
of ``Identity.labels()`` (``job_name``, ``rank``, ``local_rank``, ``world_size``, plus ``pod`` and
``namespace`` when known); ``job`` is avoided because Prometheus sets it to the scrape job.

Cardinality: by default at most ``MAX_SERIES_PER_MODULE`` series per FSDP module and at most
``MAX_OTHER_SERIES`` other series per rank. ``detail=True`` adds module x state x device x
category bytes (``SCOPE_DETAIL``), which is opt-in and capped: only the ``detail_top_k``
(default ``DEFAULT_DETAIL_TOP_K``) modules with the largest peaks get them, 144 series per module
and device (12 states x 12 categories); how many modules were left out is exported
(``DETAIL_MODULES_OMITTED``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_mem_otel import config

PREFIX = "fsdp_mem_"

GAUGE = "gauge"
COUNTER = "counter"
TYPES: tuple[str, ...] = (GAUGE, COUNTER)

BYTES = "bytes"
SECONDS = "seconds"
RATIO = "ratio"
UNITS: tuple[str, ...] = (BYTES, SECONDS, RATIO, "")

#: one series set per rank, bounded independently of the model
SCOPE_RANK = "rank"
#: one series per FSDP module (at most MAX_SERIES_PER_MODULE in all)
SCOPE_MODULE = "module"
#: opt-in (detail=True): module x state x device x category
SCOPE_DETAIL = "detail"
#: served by ``fsdp-mem-otel serve`` about the rank files it reads
SCOPE_SIDECAR = "sidecar"
#: only with an estimate (``fsdp-mem-otel estimate``): 2 series per module and 12 others
SCOPE_ESTIMATE = "estimate"
#: only in a rank's last exposition, once its exporter shut down: how the rank ended (1 series)
SCOPE_END = "end"
SCOPES: tuple[str, ...] = (SCOPE_RANK, SCOPE_MODULE, SCOPE_DETAIL, SCOPE_SIDECAR, SCOPE_ESTIMATE, SCOPE_END)

#: labels from Identity.labels() on every series of a rank (pod/namespace only when known)
IDENTITY_LABELS: tuple[str, ...] = ("job_name", "rank", "local_rank", "world_size")
OPTIONAL_IDENTITY_LABELS: tuple[str, ...] = ("pod", "namespace")

MAX_SERIES_PER_MODULE = 3
MAX_OTHER_SERIES = 100
#: modules with detail series by default (detail=True): the largest peaks first
DEFAULT_DETAIL_TOP_K = config.DEFAULT_DETAIL_TOP_K
#: detail series per module and device: 12 states x 12 categories
DETAIL_SERIES_PER_MODULE_DEVICE = 144

#: values of the ``phase`` label of module peaks
PHASES: tuple[str, ...] = ("forward", "backward")
#: values of the ``component`` label of errors_total
COMPONENT_TRACKER = "tracker"
COMPONENT_EXPORTER = "exporter"
COMPONENTS: tuple[str, ...] = (COMPONENT_TRACKER, COMPONENT_EXPORTER)
#: values of the ``reason`` label of rank_end_timestamp_seconds: why the rank's exporter shut down
END_CLEAN = "clean"  # tracker.close(), interpreter exit, a framework's end-of-training hook
END_SIGTERM = "sigterm"  # SIGTERM: preemption, eviction, torchrun stopping the workers
END_ERROR = "error"  # an uncaught exception, or a framework's exception hook
END_REASONS: tuple[str, ...] = (END_CLEAN, END_SIGTERM, END_ERROR)


@dataclass(frozen=True)
class Metric:
    """One metric family.

    ``labels`` are the metric's own labels, besides the identity labels. ``source`` names the
    StepReport field the value comes from (for allocator metrics: the key in
    ``StepReport.allocator[device]``).
    """

    name: str
    type: str
    unit: str
    help: str
    labels: tuple[str, ...] = ()
    scope: str = SCOPE_RANK
    source: str = ""

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX):
            raise ValueError(f"metric name must start with {PREFIX!r}; got {self.name!r}")
        if self.type not in TYPES:
            raise ValueError(f"{self.name}: type must be one of {TYPES}; got {self.type!r}")
        if self.unit not in UNITS:
            raise ValueError(f"{self.name}: unit must be one of {UNITS}; got {self.unit!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"{self.name}: scope must be one of {SCOPES}; got {self.scope!r}")
        base = self.name[: -len("_total")] if self.type == COUNTER else self.name
        if self.type == COUNTER and not self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counter names end in _total")
        if self.type == GAUGE and self.name.endswith("_total"):
            raise ValueError(f"{self.name}: only counters end in _total")
        if self.unit and not base.endswith("_" + self.unit):
            raise ValueError(f"{self.name}: unit {self.unit!r} must be the name's suffix")
        if not self.help.endswith("."):
            raise ValueError(f"{self.name}: help text is a sentence ending in '.'")

    @property
    def all_labels(self) -> tuple[str, ...]:
        """Identity labels (always present ones) followed by the metric's own labels."""
        if self.scope == SCOPE_SIDECAR:
            return self.labels
        return IDENTITY_LABELS + self.labels


# -- step memory (ledger) --------------------------------------------------------------------
STEP_PEAK_BYTES = Metric(
    "fsdp_mem_step_peak_bytes", GAUGE, BYTES,
    "Bytes per category at the moment of the last step's peak total on the device (category total = the peak).",
    ("device", "category"), source="peak",
)
CURRENT_BYTES = Metric(
    "fsdp_mem_current_bytes", GAUGE, BYTES,
    "Bytes per category live on the device at the end of the last step.",
    ("device", "category"), source="current",
)

# -- allocator (StepReport.allocator: device -> stat -> value) ---------------------------------
ALLOCATED_BYTES = Metric(
    "fsdp_mem_allocator_allocated_bytes", GAUGE, BYTES,
    "Bytes the device allocator has handed out to tensors, at the end of the last step.",
    ("device",), source="allocated_bytes",
)
ALLOCATED_PEAK_BYTES = Metric(
    "fsdp_mem_allocator_allocated_peak_bytes", GAUGE, BYTES,
    "The allocator's own peak of allocated bytes during the last step (reset_peaks, the default on CUDA); "
    "with reset_peaks off, the largest of readings at every FSDP hook and the step end.",
    ("device",), source="allocated_peak_bytes",
)
RESERVED_BYTES = Metric(
    "fsdp_mem_allocator_reserved_bytes", GAUGE, BYTES,
    "Bytes the caching allocator holds from the device (allocated plus cached), at the end of the last step.",
    ("device",), source="reserved_bytes",
)
RESERVED_PEAK_BYTES = Metric(
    "fsdp_mem_allocator_reserved_peak_bytes", GAUGE, BYTES,
    "The allocator's own peak of reserved bytes during the last step (reset_peaks, the default on CUDA); "
    "with reset_peaks off, the largest of readings at every FSDP hook and the step end.",
    ("device",), source="reserved_peak_bytes",
)
ACTIVE_BYTES = Metric(
    "fsdp_mem_allocator_active_bytes", GAUGE, BYTES,
    "Bytes in active allocator blocks (allocated or awaiting stream sync), at the end of the last step.",
    ("device",), source="active_bytes",
)
ACTIVE_PEAK_BYTES = Metric(
    "fsdp_mem_allocator_active_peak_bytes", GAUGE, BYTES,
    "The allocator's own peak of active bytes during the last step (reset_peaks, the default on CUDA); "
    "with reset_peaks off, the largest of readings at every FSDP hook and the step end.",
    ("device",), source="active_peak_bytes",
)
INACTIVE_SPLIT_BYTES = Metric(
    "fsdp_mem_allocator_inactive_split_bytes", GAUGE, BYTES,
    "Bytes in inactive, non-releasable split blocks (fragmentation), at the end of the last step.",
    ("device",), source="inactive_split_bytes",
)
DEVICE_TOTAL_BYTES = Metric(
    "fsdp_mem_device_total_bytes", GAUGE, BYTES,
    "Total memory of the device.",
    ("device",), source="device_total_bytes",
)
ALLOC_RETRIES_TOTAL = Metric(
    "fsdp_mem_allocator_alloc_retries_total", COUNTER, "",
    "Allocations that failed, freed the allocator cache and were retried (cudaMalloc retries).",
    ("device",), source="num_alloc_retries",
)
OOMS_TOTAL = Metric(
    "fsdp_mem_allocator_ooms_total", COUNTER, "",
    "Out-of-memory errors raised by the device allocator.",
    ("device",), source="num_ooms",
)
FRAGMENTATION_RATIO = Metric(
    "fsdp_mem_allocator_fragmentation_ratio", GAUGE, RATIO,
    "Share of reserved bytes not allocated to tensors (1 - allocated / reserved), at the end of the last step.",
    ("device",), source="fragmentation_ratio",
)
UNTRACKED_BYTES = Metric(
    "fsdp_mem_untracked_bytes", GAUGE, BYTES,
    "Bytes allocated on the device that the tracker did not attribute to any category.",
    ("device",), source="untracked_bytes",
)
OUTSIDE_PYTORCH_BYTES = Metric(
    "fsdp_mem_outside_pytorch_bytes", GAUGE, BYTES,
    "Device memory in use that PyTorch's allocator does not hold (used - reserved): CUDA context, NCCL, cuBLAS.",
    ("device",), source="outside_pytorch_bytes",
)
RESIDENT_BYTES = Metric(
    "fsdp_mem_process_resident_bytes", GAUGE, BYTES,
    "Resident set size of the training process (host memory).",
    ("device",), source="resident_bytes",
)

#: allocator statistic key -> metric
ALLOCATOR_METRICS: dict[str, Metric] = {
    m.source: m
    for m in (
        ALLOCATED_BYTES,
        ALLOCATED_PEAK_BYTES,
        RESERVED_BYTES,
        RESERVED_PEAK_BYTES,
        ACTIVE_BYTES,
        ACTIVE_PEAK_BYTES,
        INACTIVE_SPLIT_BYTES,
        DEVICE_TOTAL_BYTES,
        ALLOC_RETRIES_TOTAL,
        OOMS_TOTAL,
        FRAGMENTATION_RATIO,
        UNTRACKED_BYTES,
        OUTSIDE_PYTORCH_BYTES,
        RESIDENT_BYTES,
    )
}

# -- tracker health ----------------------------------------------------------------------------
STEPS_TOTAL = Metric(
    "fsdp_mem_steps_total", COUNTER, "",
    "Training steps the tracker has closed.",
    source="step",
)
ERRORS_TOTAL = Metric(
    "fsdp_mem_errors_total", COUNTER, "",
    "Internal failures, by component (tracker; exporter: this exporter's I/O and server failures); never raised.",
    ("component",), source="errors_total",
)
OVERHEAD_SECONDS = Metric(
    "fsdp_mem_step_overhead_seconds", GAUGE, SECONDS,
    "Time in the tracker's module-state hooks (one call in 13 timed, counted for each) and its deferred "
    "accounting during the last step: a lower bound (FSDP group and saved-tensor hooks are not timed).",
    source="tracker_overhead_seconds",
)
OVERHEAD_SECONDS_TOTAL = Metric(
    "fsdp_mem_tracker_overhead_seconds_total", COUNTER, SECONDS,
    "Time in the tracker's module-state hooks (one call in 13 timed, counted for each) and its deferred "
    "accounting over all exported steps: a lower bound (FSDP group and saved-tensor hooks are not timed).",
    source="tracker_overhead_seconds",
)
LAST_STEP_TIMESTAMP_SECONDS = Metric(
    "fsdp_mem_last_step_timestamp_seconds", GAUGE, SECONDS,
    "Unix time at which the last step closed.",
    source="timestamp",
)
STEP_DURATION_SECONDS = Metric(
    "fsdp_mem_step_duration_seconds", GAUGE, SECONDS,
    "Wall-clock duration of the last step (between two tracker.step() calls).",
    source="duration_seconds",
)
STEP_DEEP = Metric(
    "fsdp_mem_step_deep", GAUGE, "",
    "1 when the last step ran in deep mode (every op accounted), 0 in light mode.",
    source="mode",
)
TRACKER_INFO = Metric(
    "fsdp_mem_tracker_info", GAUGE, "",
    "Always 1; labels say the FSDP generation, the fsdp_mem_otel version and the node the rank runs on "
    "(NODE_NAME, else the host name).",
    ("fsdp_version", "version", "node"), source="fsdp_version",
)
RANK_END_TIMESTAMP_SECONDS = Metric(
    "fsdp_mem_rank_end_timestamp_seconds", GAUGE, SECONDS,
    "Unix time at which the rank's exporter shut down, by reason: clean (tracker.close(), interpreter exit, a "
    "framework's end-of-training hook), sigterm (SIGTERM: preemption, eviction), error (an uncaught exception or "
    "a framework's exception hook). Absent while the rank runs.",
    ("reason",), scope=SCOPE_END,
)

ABORTED_STEPS_TOTAL = Metric(
    "fsdp_mem_aborted_steps_total", COUNTER, "",
    "Steps stopped early by an exception (kind=oom for out-of-memory, kind=error otherwise).",
    ("kind",), source="aborted",
)
DEEP_STEPS_SKIPPED_TOTAL = Metric(
    "fsdp_mem_deep_steps_skipped_total", COUNTER, "",
    "Steps due to run deep that stayed light (reason=compiled: the model runs code compiled by torch.compile).",
    ("reason",), source="deep_skipped",
)
SETUP_WARNING = Metric(
    "fsdp_mem_setup_warning", GAUGE, "",
    "1 while the tracker has found this problem with what it measures, else 0: kind=optimizer_no_state (the "
    "optimizer stepped with gradients present and holds no state, so optimizer_state reads 0), "
    "kind=nothing_sharded (a multi-rank job whose FSDP shard groups all have one rank).",
    ("kind",), source="warnings",
)
LIGHT_FALLBACK_GROUPS = Metric(
    "fsdp_mem_light_fallback_groups", GAUGE, "",
    "FSDP groups light mode accounts per tensor because their own events cannot tell their buffers' bytes "
    "(a parameter with a gradient in some steps only, all-gather extensions); 0 on every tested configuration.",
    source="fallback_groups",
)
#: leak series per rank, each kind: the fastest-growing categories, the largest holders
LEAK_SERIES = 3
LEAK_GROWTH = Metric(
    "fsdp_mem_leak_growth_bytes_per_step", GAUGE, "",
    "Bytes per step by which the category's live bytes at the step end grow (they never fell and rose at half "
    "the last steps or more: a leak, StepReport.leak); only while it grows, the 3 fastest categories.",
    ("category",), source="leak",
)
STEP_END_HELD_BYTES = Metric(
    "fsdp_mem_step_end_held_bytes", GAUGE, BYTES,
    "Bytes the FSDP module's saved tensors, inputs and outputs still hold at the step end, after the optimizer "
    "step (light mode; a healthy step frees them); only while held, the 3 largest holders.",
    ("module",), source="leak",
)
LAST_OOM_TIMESTAMP_SECONDS = Metric(
    "fsdp_mem_last_oom_timestamp_seconds", GAUGE, SECONDS,
    "Unix time of the last out-of-memory step, labelled with the FSDP module and state that were active.",
    ("module", "state"), source="aborted",
)
LAST_OOM_BYTES = Metric(
    "fsdp_mem_last_oom_bytes", GAUGE, BYTES,
    "Live bytes by category at the moment of the last out-of-memory error, on the fullest device.",
    ("device", "category"), source="aborted",
)
LAST_OOM_OUTSIDE_PYTORCH_BYTES = Metric(
    "fsdp_mem_last_oom_outside_pytorch_bytes", GAUGE, BYTES,
    "Device memory outside PyTorch's allocator (CUDA context, NCCL, cuBLAS) at the last out-of-memory error.",
    ("device",), source="aborted",
)

# -- per FSDP module (default, bounded per module) ----------------------------------------------
MODULE_PEAK_BYTES = Metric(
    "fsdp_mem_module_peak_bytes", GAUGE, BYTES,
    "Peak total bytes during the module's forward or backward in the last step (max over calls and devices).",
    ("module", "phase"), scope=SCOPE_MODULE, source="modules",
)
MODULE_FORWARD_SECONDS = Metric(
    "fsdp_mem_module_forward_seconds", GAUGE, SECONDS,
    "Wall-clock time of the module's forward in the last step, summed over its calls.",
    ("module",), scope=SCOPE_MODULE, source="modules",
)

# -- opt-in full detail ------------------------------------------------------------------------
MODULE_STATE_BYTES = Metric(
    "fsdp_mem_module_state_bytes", GAUGE, BYTES,
    "Bytes per category on the device at the module's state in the last step (max over calls); detail=True only.",
    ("module", "state", "device", "category"), scope=SCOPE_DETAIL, source="modules",
)

DETAIL_MODULES_OMITTED = Metric(
    "fsdp_mem_detail_modules_omitted", GAUGE, "",
    "FSDP modules of the last step without detail series (the detail budget keeps the top-K modules by peak); "
    "detail=True only.",
    (), scope=SCOPE_DETAIL,
)

# -- an estimate beside the measurement (PrometheusExporter(estimate=...)) ----------------------
ESTIMATE_STEP_PEAK_BYTES = Metric(
    "fsdp_mem_estimate_step_peak_bytes", GAUGE, BYTES,
    "The estimate's bytes per category at its step peak (fsdp-mem-otel estimate), beside fsdp_mem_step_peak_bytes.",
    ("category",), scope=SCOPE_ESTIMATE,
)
ESTIMATE_MODULE_PEAK_BYTES = Metric(
    "fsdp_mem_estimate_module_peak_bytes", GAUGE, BYTES,
    "The estimate's peak total during the module's forward or backward, beside fsdp_mem_module_peak_bytes.",
    ("module", "phase"), scope=SCOPE_ESTIMATE,
)

# -- sidecar (fsdp-mem-otel serve) -------------------------------------------------------------
SIDECAR_RANK_LAST_UPDATE = Metric(
    "fsdp_mem_sidecar_rank_last_update_timestamp_seconds", GAUGE, SECONDS,
    "Unix time at which the rank last rewrote its metrics file (its modification time).",
    ("rank",), scope=SCOPE_SIDECAR,
)
SIDECAR_RANK_STALE = Metric(
    "fsdp_mem_sidecar_rank_stale", GAUGE, "",
    "1 when the rank's metrics file is older than the sidecar's --stale-seconds (rank dead or stuck), else 0.",
    ("rank",), scope=SCOPE_SIDECAR,
)
SIDECAR_READ_ERRORS_TOTAL = Metric(
    "fsdp_mem_sidecar_read_errors_total", COUNTER, "",
    "Rank metrics files the sidecar could not read or parse (the rank's samples are left out).",
    ("rank",), scope=SCOPE_SIDECAR,
)
SIDECAR_REFUSED_FILES_TOTAL = Metric(
    "fsdp_mem_sidecar_refused_files_total", COUNTER, "",
    "Rank file reads the sidecar refused: reason=not_regular (a symlink, FIFO or device), too_large, too_many.",
    ("reason",), scope=SCOPE_SIDECAR,
)
SIDECAR_DIRECTORY_READABLE = Metric(
    "fsdp_mem_sidecar_directory_readable", GAUGE, "",
    "1 when the sidecar could list its directory at the last scrape, else 0 (the ranks then go stale).",
    (), scope=SCOPE_SIDECAR,
)

#: every metric, in exposition order
METRICS: tuple[Metric, ...] = (
    STEP_PEAK_BYTES,
    CURRENT_BYTES,
    *ALLOCATOR_METRICS.values(),
    STEPS_TOTAL,
    ERRORS_TOTAL,
    OVERHEAD_SECONDS,
    OVERHEAD_SECONDS_TOTAL,
    LAST_STEP_TIMESTAMP_SECONDS,
    STEP_DURATION_SECONDS,
    STEP_DEEP,
    TRACKER_INFO,
    RANK_END_TIMESTAMP_SECONDS,
    ABORTED_STEPS_TOTAL,
    DEEP_STEPS_SKIPPED_TOTAL,
    SETUP_WARNING,
    LIGHT_FALLBACK_GROUPS,
    LEAK_GROWTH,
    STEP_END_HELD_BYTES,
    LAST_OOM_TIMESTAMP_SECONDS,
    LAST_OOM_BYTES,
    LAST_OOM_OUTSIDE_PYTORCH_BYTES,
    MODULE_PEAK_BYTES,
    MODULE_FORWARD_SECONDS,
    MODULE_STATE_BYTES,
    DETAIL_MODULES_OMITTED,
    ESTIMATE_STEP_PEAK_BYTES,
    ESTIMATE_MODULE_PEAK_BYTES,
    SIDECAR_RANK_LAST_UPDATE,
    SIDECAR_RANK_STALE,
    SIDECAR_READ_ERRORS_TOTAL,
    SIDECAR_REFUSED_FILES_TOTAL,
    SIDECAR_DIRECTORY_READABLE,
)

_BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
if len(_BY_NAME) != len(METRICS):
    raise RuntimeError("duplicate metric name in catalog")
# OpenMetrics names a counter family without "_total": it must not clash with another name.
_FAMILIES = [m.name[: -len("_total")] if m.type == COUNTER else m.name for m in METRICS]
if len(set(_FAMILIES)) != len(_FAMILIES):
    raise RuntimeError("a counter's family name (without _total) clashes with another metric")


def metric(name: str) -> Metric:
    """The metric called ``name`` (KeyError naming the known ones otherwise)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; known: {', '.join(_BY_NAME)}") from None


def all_names(scope: str | None = None) -> tuple[str, ...]:
    """Every metric name, in catalog order; only those of ``scope`` when given."""
    return tuple(m.name for m in by_scope(scope))


def by_scope(scope: str | None = None) -> tuple[Metric, ...]:
    """Metrics of one scope (``SCOPE_RANK``, ``SCOPE_MODULE``, ...); all when ``scope`` is None."""
    if scope is not None and scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES} or None; got {scope!r}")
    return tuple(m for m in METRICS if scope is None or m.scope == scope)


def exported_names(detail: bool = False, estimate: bool = False, ended: bool = False) -> tuple[str, ...]:
    """Names a rank's exporter can emit (``detail``: with the detail series, ``estimate``: with an
    estimate given, ``ended``: once it shut down)."""
    scopes = (SCOPE_RANK, SCOPE_MODULE) + ((SCOPE_DETAIL,) if detail else ()) + ((SCOPE_ESTIMATE,) if estimate else ())
    scopes += (SCOPE_END,) if ended else ()
    return tuple(m.name for m in METRICS if m.scope in scopes)


def selector(m: Metric | str, **matchers: str) -> str:
    """A PromQL selector, e.g. ``selector(STEP_PEAK_BYTES, category="total")``."""
    name = m.name if isinstance(m, Metric) else metric(m).name
    if not matchers:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(matchers.items()))
    return f"{name}{{{inner}}}"
