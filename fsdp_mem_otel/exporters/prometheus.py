"""Prometheus exporter: a custom collector over the latest StepReport, served per rank and/or
written to a sidecar directory. Does not import torch.

Collection is apart from encoding, as in prometheus_client: ``StepReportCollector.collect()``
builds metric families from the last report at scrape time (every name, type, help and label
comes from ``fsdp_mem_otel.fleet.catalog``), and ``generate_latest`` encodes them. The sidecar file
is the same text, written by ``StepReportCollector.exposition()``, which keeps each series' escaped
labels between renders. ``export()`` only swaps a reference and wakes the sidecar writer thread, so
a training step never waits for a scrape or a file write.

Two ways out, usable together:

- HTTP: ``/metrics`` on ``base_port + local_rank`` (or ``port``), optionally TLS or mutual TLS.
- Sidecar: the exposition of every step written atomically (temp file in the same directory,
  then ``os.replace``) to ``<sidecar_dir>/rank-<rank>.prom``; ``fsdp-mem-otel serve`` merges a
  directory of those into one endpoint and flags ranks whose file stopped changing.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import UNDERSCORES, escape_label_name, escape_metric_name
from prometheus_client.utils import floatToGoString

from fsdp_mem_otel import __version__, env
from fsdp_mem_otel.checks import check_int
from fsdp_mem_otel.config import DEFAULT_BASE_PORT, DEFAULT_SIDECAR_INTERVAL, PrometheusConfig
from fsdp_mem_otel.exporters.peaks import peaks
from fsdp_mem_otel.exporters.worker import BackgroundWorker, at_exit, end_reason
from fsdp_mem_otel.failures import FailureLog
from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.fleet.rank_files import rank_file_name
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import (
    AFTER_POST_FORWARD,
    BEFORE_PRE_FORWARD,
    CATEGORY_KEYS,
    DEEP,
    DEEP_SKIP_REASONS,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    STATES,
    TOTAL,
    WARNINGS,
    StepAbort,
    StepReport,
)

logger = logging.getLogger(__name__)

_FILE_MODE = 0o644
_DIR_MODE = 0o700
#: one family as built from a report: its catalog entry and its rows (own label values, value);
#: the identity labels go in front of every row's labels
_Rows = tuple[cat.Metric, list[tuple[tuple[str, ...], float]]]


def _family(m: cat.Metric, labels: tuple[str, ...]) -> GaugeMetricFamily | CounterMetricFamily:
    cls = CounterMetricFamily if m.type == cat.COUNTER else GaugeMetricFamily
    return cls(m.name, m.help, labels=list(labels))


class _Fixed:
    """A fixed list of families, as prometheus_client's generate_latest wants them."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _head(m: cat.Metric) -> str:
    """A family's ``# HELP`` and ``# TYPE`` lines, written by generate_latest itself."""
    return generate_latest(_Fixed([_family(m, ())])).decode("utf-8")


def _sample_name(m: cat.Metric) -> str:
    """The name on a family's sample lines (a counter's samples end in ``_total``)."""
    return _family(m, ()).name + ("_total" if m.type == cat.COUNTER else "")


def _escape_value(v: str) -> str:
    """A label value as the text format escapes it (prometheus_client's own rule)."""
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


class StepReportCollector:
    """prometheus_client collector: the last StepReport as metric families, built at scrape time.

    Register it in a ``CollectorRegistry``; call ``update(report)`` once per step (cheap: one
    reference swap and one addition under a lock).
    """

    def __init__(self, identity: Identity, *, detail: bool = False, detail_top_k: int = cat.DEFAULT_DETAIL_TOP_K,
                 failures: FailureLog | None = None) -> None:
        if not isinstance(identity, Identity):
            raise TypeError(f"identity must be an fsdp_mem_otel.identity.Identity; got {type(identity).__name__}")
        #: the owning exporter's failures (exported as errors_total{component="exporter"})
        self.failures = failures if failures is not None else FailureLog(logger, "Prometheus exporter")
        self.identity = identity
        self.detail = bool(detail)
        check_int("detail_top_k", detail_top_k, 1)
        #: with detail: the modules with the largest peaks that get detail series
        self.detail_top_k = detail_top_k
        self._id_names = tuple(identity.labels())
        self._id_values = tuple(identity.labels().values())
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        #: exposition(): each metric's HELP/TYPE lines and sample name, and each series of the
        #: last render: (metric name, own label values) -> (``name{labels} ``, value, its line)
        self._heads: dict[str, tuple[str, str]] = {}
        self._series: dict[tuple[str, tuple[str, ...]], tuple[str, float, str]] = {}
        self._report: StepReport | None = None
        self._overhead_total = 0.0
        self._aborted = {"oom": 0, "error": 0}
        self._deep_skipped = dict.fromkeys(DEEP_SKIP_REASONS, 0)
        self._last_oom: tuple[float, StepAbort] | None = None
        #: a StepReport from ``fsdp-mem-otel estimate``, exported beside each step's figures
        self.estimate: StepReport | None = None
        #: (reason, unix time) once the exporter shut down: the rank's recorded end. Set without the
        #: lock: the SIGTERM handler sets it on the training thread, which may hold the lock.
        self.end: tuple[str, float] | None = None

    # -- state -------------------------------------------------------------------------------
    def update(self, report: StepReport) -> None:
        with self._lock:
            if self._report is None or report.step != self._report.step:  # the same step twice counts once
                self._overhead_total += float(report.tracker_overhead_seconds)
                if report.deep_skipped is not None:
                    self._deep_skipped[report.deep_skipped] = self._deep_skipped.get(report.deep_skipped, 0) + 1
                if report.aborted is not None:
                    kind = "oom" if report.aborted.oom else "error"
                    self._aborted[kind] += 1
                    if report.aborted.oom:
                        self._last_oom = (report.timestamp, report.aborted)
            self._report = report

    @property
    def exporter_errors(self) -> int:
        return self.failures.total

    @property
    def report(self) -> StepReport | None:
        return self._report

    # -- prometheus_client Collector protocol -------------------------------------------------
    def describe(self) -> list[Metric]:
        """Families this collector may yield (lets a registry detect duplicate names)."""
        return [
            _family(m, self._id_names + m.labels)
            for m in cat.METRICS
            if m.name in cat.exported_names(self.detail, self.estimate is not None, self.end is not None)
        ]

    def collect(self) -> Iterator[Metric]:
        ids, idv = self._id_names, self._id_values
        for m, rows in self._built():
            fam = _family(m, ids + m.labels)
            for values, value in rows:
                fam.add_metric(list(idv + values), value)
            yield fam

    def exposition(self) -> bytes:
        """What ``generate_latest(collector)`` writes for this collector, byte for byte, at a
        fraction of its cost (the sidecar file renders this).

        ``generate_latest`` escapes and validates every label name and value of every sample
        (the same identity labels ~340 times at 100 modules). Here each series' line is made once
        and kept while the series exists: its text up to the value (``name{labels} ``), and the
        whole line with the last value written, reused while the value stays the same. A render
        reuses the previous render's lines and keeps only the series it wrote, so a series that
        is gone (a module that left the report) is forgotten at once.
        """
        built = self._built()
        with self._render_lock:  # one render at a time: the kept lines are swapped at the end
            known = self._series
            kept: dict[tuple[str, tuple[str, ...]], tuple[str, float, str]] = {}
            out: list[str] = []
            for m, rows in built:
                head = self._heads.get(m.name)
                if head is None:
                    head = self._heads[m.name] = (_head(m), _sample_name(m))
                out.append(head[0])
                for values, value in rows:
                    key = (m.name, values)
                    line = known.get(key)
                    if line is None:
                        prefix = self._series_text(head[1], m, values)
                    elif line[1] == value and value:  # not for 0.0: -0.0 equals it and is written "-0.0"
                        kept[key] = line
                        out.append(line[2])
                        continue
                    else:
                        prefix = line[0]
                    text = f"{prefix}{floatToGoString(value)}\n"
                    kept[key] = (prefix, value, text)
                    out.append(text)
            self._series = kept
        return "".join(out).encode("utf-8")

    def _series_text(self, name: str, m: cat.Metric, values: tuple[str, ...]) -> str:
        """``name{labels} `` as generate_latest writes it: labels sorted by name, names and
        values escaped by prometheus_client's rules (text format 0.0.4)."""
        labels = dict(zip(self._id_names + m.labels, self._id_values + values, strict=True))
        if not labels:
            return f"{escape_metric_name(name, UNDERSCORES)} "
        text = ",".join(f'{escape_label_name(k, UNDERSCORES)}="{_escape_value(v)}"' for k, v in sorted(labels.items()))
        return f"{escape_metric_name(name, UNDERSCORES)}{{{text}}} "

    def _built(self) -> list[_Rows]:
        """This collector's families as (catalog metric, rows); a report that cannot be read is
        counted and leaves the health series only."""
        with self._lock:
            report, overhead_total = self._report, self._overhead_total
        try:
            built = self._families(report, overhead_total, self.failures.total)
            self.failures.recovered("building metrics")
        except Exception as exc:  # noqa: BLE001 - a malformed report must not break the scrape
            self.failures.failed("building metrics", exc)
            built = self._families(None, overhead_total, self.failures.total)
        return built

    # -- building ----------------------------------------------------------------------------
    def _families(self, report: StepReport | None, overhead_total: float, exporter_errors: int) -> list[_Rows]:
        out: list[_Rows] = []

        def add(m: cat.Metric, rows: list[tuple[tuple[str, ...], float]]) -> None:
            if rows:  # no empty families
                out.append((m, rows))

        if report is not None:
            for m, breakdown in ((cat.STEP_PEAK_BYTES, report.peak), (cat.CURRENT_BYTES, report.current)):
                add(m, [
                    ((dev, c), float(cats.get(c, 0))) for dev, cats in sorted(breakdown.items()) for c in CATEGORY_KEYS
                ])
            for key, m in cat.ALLOCATOR_METRICS.items():
                add(m, [((dev,), float(stats[key])) for dev, stats in sorted(report.allocator.items()) if key in stats])
            add(cat.STEPS_TOTAL, [((), float(report.step))])
        else:
            add(cat.STEPS_TOTAL, [((), 0.0)])
        tracker_errors = float(report.errors_total) if report is not None else 0.0
        add(cat.ERRORS_TOTAL, [
            ((cat.COMPONENT_TRACKER,), tracker_errors),
            ((cat.COMPONENT_EXPORTER,), float(exporter_errors)),
        ])
        if report is not None:
            add(cat.OVERHEAD_SECONDS, [((), float(report.tracker_overhead_seconds))])
        add(cat.OVERHEAD_SECONDS_TOTAL, [((), overhead_total)])
        if report is not None:
            add(cat.LAST_STEP_TIMESTAMP_SECONDS, [((), float(report.timestamp))])
            add(cat.STEP_DURATION_SECONDS, [((), float(report.duration_seconds))])
            add(cat.STEP_DEEP, [((), 1.0 if report.mode == DEEP else 0.0)])
        fsdp_version = str(report.fsdp_version) if report is not None else ""
        add(cat.TRACKER_INFO, [((fsdp_version, __version__, self.identity.node or self.identity.host), 1.0)])
        end = self.end
        if end is not None:
            add(cat.RANK_END_TIMESTAMP_SECONDS, [((end[0],), end[1])])
        with self._lock:
            aborted, last_oom = dict(self._aborted), self._last_oom
            skipped = dict(self._deep_skipped)
        add(cat.ABORTED_STEPS_TOTAL, [((kind,), float(n)) for kind, n in sorted(aborted.items())])
        add(cat.DEEP_STEPS_SKIPPED_TOTAL, [((reason,), float(n)) for reason, n in sorted(skipped.items())])
        if report is not None:
            add(cat.SETUP_WARNING, [((kind,), float(kind in report.warnings)) for kind in WARNINGS])
            add(cat.LIGHT_FALLBACK_GROUPS, [((), float(report.fallback_groups))])
            if report.leak is not None:  # only while something grows or is held: a bounded few series
                fastest = sorted(report.leak.growing.items(), key=lambda kv: -kv[1])[:cat.LEAK_SERIES]
                add(cat.LEAK_GROWTH, [((c,), float(v)) for c, v in fastest])
                add(cat.STEP_END_HELD_BYTES,
                    [((m,), float(n)) for m, n in list(report.leak.held.items())[:cat.LEAK_SERIES]])
        if last_oom is not None:
            when, abort = last_oom
            add(cat.LAST_OOM_TIMESTAMP_SECONDS, [((abort.module, abort.state), float(when))])
            if abort.breakdown:  # the fullest device only: the one that ran out, in a bounded series count
                dev = max(sorted(abort.breakdown), key=lambda d: abort.breakdown[d].get("total", 0))
                cats = abort.breakdown[dev]
                add(cat.LAST_OOM_BYTES, [((dev, c), float(cats.get(c, 0))) for c in CATEGORY_KEYS])
            if abort.outside_pytorch_bytes:
                add(cat.LAST_OOM_OUTSIDE_PYTORCH_BYTES,
                    [((dev,), float(n)) for dev, n in sorted(abort.outside_pytorch_bytes.items())])
        if report is not None:
            out.extend(self._module_families(report))
        if self.estimate is not None:
            out.extend(self._estimate_families(self.estimate))
        return out

    def _estimate_families(self, estimate: StepReport) -> list[_Rows]:
        step: list[tuple[tuple[str, ...], float]] = []
        if estimate.peak:  # the device with the largest peak: the one the estimate is about
            dev = max(sorted(estimate.peak), key=lambda d: estimate.peak[d].get(TOTAL, 0))
            step = [((c,), float(estimate.peak[dev].get(c, 0))) for c in CATEGORY_KEYS]
        modules: list[tuple[tuple[str, ...], float]] = [
            ((key, phase), float(mod.peak_total(state)))
            for key, mod in sorted(estimate.modules.items())
            for phase, state in (("forward", PEAK_FORWARD), ("backward", PEAK_BACKWARD))
            if mod.snapshots.get(state)
        ]
        return [(m, rows) for m, rows in ((cat.ESTIMATE_STEP_PEAK_BYTES, step),
                                          (cat.ESTIMATE_MODULE_PEAK_BYTES, modules)) if rows]

    def _module_families(self, report: StepReport) -> list[_Rows]:
        order = [k for k in report.module_order if k in report.modules]
        listed = set(order)
        order += sorted(k for k in report.modules if k not in listed)
        peak: list[tuple[tuple[str, ...], float]] = []
        fwd: list[tuple[tuple[str, ...], float]] = []
        detail: list[tuple[tuple[str, ...], float]] = []
        detailed = _largest(report, order, self.detail_top_k) if self.detail else set()
        for key in order:
            mod = report.modules[key]
            fwd_peak, bwd_peak = peaks(mod)  # from the counters: no snapshot dicts built
            if fwd_peak is not None:
                peak.append(((key, "forward"), float(fwd_peak)))
            if bwd_peak is not None:
                peak.append(((key, "backward"), float(bwd_peak)))
            starts, ends = mod.times_of(BEFORE_PRE_FORWARD), mod.times_of(AFTER_POST_FORWARD)
            if starts and ends:
                if len(starts) == 1 and len(ends) == 1:  # one call: nearly every module
                    seconds = max(0, ends[0] - starts[0]) / 1e9
                else:
                    seconds = sum(max(0, e - s) for s, e in zip(starts, ends, strict=False)) / 1e9
                fwd.append(((key,), seconds))
            if key in detailed:
                snapshots = mod.snapshots
                for state in STATES:
                    calls = snapshots.get(state)
                    if not calls:
                        continue
                    merged: dict[str, dict[str, int]] = {}
                    for breakdown in calls:
                        for dev, cats in breakdown.items():
                            into = merged.setdefault(dev, {})
                            for c, v in cats.items():
                                if v > into.get(c, -1):
                                    into[c] = v
                    for dev in sorted(merged):
                        for c in CATEGORY_KEYS:
                            detail.append(((key, state, dev, c), float(merged[dev].get(c, 0))))
        families: list[_Rows] = [(m, rows) for m, rows in ((cat.MODULE_PEAK_BYTES, peak),
                                                           (cat.MODULE_FORWARD_SECONDS, fwd),
                                                           (cat.MODULE_STATE_BYTES, detail)) if rows]
        if self.detail:
            families.append((cat.DETAIL_MODULES_OMITTED, [((), float(len(order) - len(detailed)))]))
        return families


def _largest(report: StepReport, order: list[str], k: int) -> set[str]:
    """The ``k`` modules with the largest forward/backward peak total (first in ``order`` on ties)."""
    def peak(key: str) -> int:
        return max((p for p in peaks(report.modules[key]) if p is not None), default=0)

    ranked = sorted(range(len(order)), key=lambda i: (-peak(order[i]), i))
    return {order[i] for i in ranked[:k]}


class PrometheusExporter:
    """StepReports to Prometheus: ``/metrics`` per rank and/or one file per rank for a sidecar.

    Args:
        identity: labels for every series (default: ``Identity.from_env()``: torchrun and
            Kubernetes variables).
        port: port to serve on; default ``base_port + local_rank``. 0 picks a free port
            (read it back from ``.port``).
        base_port: first port when ``port`` is None, so that ranks sharing a node do not clash.
        addr: address to listen on. Default "0.0.0.0", so that Prometheus can scrape the pod IP;
            use "127.0.0.1" to keep the endpoint local (e.g. behind the sidecar).
        certfile, keyfile: serve HTTPS with this certificate and key (PEM).
        client_cafile: with certfile/keyfile, require client certificates signed by this CA
            (mutual TLS).
        detail: also export module x state x device x category bytes (many series; opt-in).
        detail_top_k: with ``detail``, only the K modules with the largest peaks get them
            (144 series per module and device); the others are counted in
            ``fsdp_mem_detail_modules_omitted``.
        estimate: a StepReport, or the JSONL file ``fsdp-mem-otel estimate`` wrote (this rank's
            report there, else its last one), exported beside every step's figures as
            ``fsdp_mem_estimate_step_peak_bytes`` and ``fsdp_mem_estimate_module_peak_bytes``.
            A file that cannot be read is logged and counted; the exporter runs without it.
        sidecar_dir: also write the exposition of every step to ``<sidecar_dir>/rank-<rank>.prom``
            (atomically; the directory is created with mode 0700 if missing).
        registry: register the collector here (default: a private ``CollectorRegistry``) and
            serve that registry.
        http: serve ``/metrics`` over HTTP (default True); False for sidecar-only export.
        config: all of the above as one ``PrometheusConfig`` (then the keywords are not used).
        env_names: the configuration came from the environment (``build_exporters``): messages
            name its variables (``FSDP_MEM_OTEL_PROMETHEUS_PORT``) rather than the keywords.
        heartbeat_seconds: between steps, refresh the sidecar file's modification time this often,
            so the sidecar marks a rank stale only when its process is gone (a rank stuck in a
            collective stays fresh; its last-step timestamp shows it is stuck).
        sidecar_interval_seconds: rewrite the sidecar file at most this often (default 15 s, the
            newest step each time; 0: every step); an aborted step, ``flush()`` and
            ``shutdown()`` write at once.

    Never raises into training for I/O: a port already taken, an unwritable directory or a
    failed write is logged once, counted in ``fsdp_mem_errors_total{component="exporter"}`` and
    retried on the next step (writes) or given up (the endpoint: a port in use, an address or TLS
    file that cannot be served is said in one line, naming the port and how to fix it).
    """

    def __init__(
        self,
        identity: Identity | None = None,
        *,
        port: int | None = None,
        base_port: int = DEFAULT_BASE_PORT,
        addr: str = "0.0.0.0",
        certfile: str | None = None,
        keyfile: str | None = None,
        client_cafile: str | None = None,
        detail: bool = False,
        detail_top_k: int = cat.DEFAULT_DETAIL_TOP_K,
        sidecar_dir: str | os.PathLike[str] | None = None,
        estimate: str | os.PathLike[str] | StepReport | None = None,
        registry: CollectorRegistry | None = None,
        http: bool = True,
        heartbeat_seconds: float = 10.0,
        sidecar_interval_seconds: float = DEFAULT_SIDECAR_INTERVAL,
        config: PrometheusConfig | None = None,
        env_names: bool = False,
    ) -> None:
        if identity is None:
            identity = Identity.from_env()
        if config is None:
            config = PrometheusConfig(
                http=http, port=port, base_port=base_port, addr=addr, certfile=certfile, keyfile=keyfile,
                client_cafile=client_cafile, detail=detail, detail_top_k=detail_top_k,
                sidecar_dir=None if sidecar_dir is None else os.fspath(sidecar_dir),
                estimate=None if estimate is None or isinstance(estimate, StepReport) else os.fspath(estimate),
                heartbeat_seconds=heartbeat_seconds, sidecar_interval_seconds=sidecar_interval_seconds)
        elif not isinstance(config, PrometheusConfig):
            raise TypeError(f"config must be a PrometheusConfig or None; got {type(config).__name__}")
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise TypeError(f"registry must be a prometheus_client CollectorRegistry; got {type(registry).__name__}")
        self.config = config
        self.identity = identity
        self._env_names = env_names
        self.failures = FailureLog(logger, "Prometheus exporter")
        self.collector = StepReportCollector(identity, detail=config.detail, detail_top_k=config.detail_top_k,
                                             failures=self.failures)
        if isinstance(estimate, StepReport):
            self.collector.estimate = estimate
        elif config.estimate is not None:
            self.collector.estimate = self._load_estimate(config.estimate, identity.rank)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self.collector)
        self.addr = config.addr
        self.port: int | None = None
        self.sidecar_path: str | None = None
        self._lock = threading.RLock()  # shutdown() may re-enter from the SIGTERM handler
        self._closed = False
        self._server: Any = None
        self._writer: _SidecarWriter | None = None

        if config.http:
            want = config.port if config.port is not None else config.base_port + identity.local_rank
            self._start_http(want, config.certfile, config.keyfile, config.client_cafile)
        if config.sidecar_dir is not None:
            directory = config.sidecar_dir
            self.sidecar_path = os.path.join(directory, rank_file_name(identity.rank))
            self._writer = _SidecarWriter(directory, self.sidecar_path, self._render, self.failures,
                                          config.heartbeat_seconds, config.sidecar_interval_seconds)
            # at interpreter exit and on SIGTERM too: the last rank file records how the rank ended
            at_exit(self.shutdown)

    def _load_estimate(self, path: str, rank: int) -> StepReport | None:
        from fsdp_mem_otel.offline.jsonl_format import read_reports

        try:
            reports = list(read_reports(path))
            if not reports:
                raise ValueError("no step report in it")
        except (OSError, ValueError) as exc:
            self.failures.failed("reading the estimate", exc, f"estimate {path!r} not used: {exc}")
            return None
        mine = [r for r in reports if r.rank == rank]
        return (mine or reports)[-1]

    @property
    def errors_total(self) -> int:
        """This exporter's own failures (also exported as errors_total{component="exporter"})."""
        return self.collector.exporter_errors

    # -- Exporter protocol ------------------------------------------------------------------
    def export(self, report: StepReport) -> None:
        """Keep ``report`` for the next scrape and wake the sidecar writer. Never raises."""
        try:
            self.collector.update(report)
            if self._writer is not None and not self._closed:
                self._writer.request(urgent=report.aborted is not None)
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
            self._io_error("export", exc)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the sidecar file holds the last exported report; False on timeout or error."""
        return self._writer.flush(timeout) if self._writer is not None else True

    def shutdown(self) -> None:
        """Write the last report to the sidecar file, with the rank's end
        (``fsdp_mem_rank_end_timestamp_seconds{reason}``: ``worker.end_reason()``), and stop the HTTP
        server. Safe to call twice; called at interpreter exit and on SIGTERM too."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._writer is not None:
            if self.collector.report is not None:  # a rank that exported nothing was never visible
                self.collector.end = (end_reason(), time.time())
                self._writer.request(urgent=True)
            self._writer.close(timeout=5.0)
        server, self._server = self._server, None
        if server is not None:
            try:
                server.stop(timeout=2.0)
            except Exception as exc:  # noqa: BLE001
                self._io_error("http-stop", exc)

    # -- internals ---------------------------------------------------------------------------
    def _render(self) -> bytes:
        # Only this collector's families: a shared registry's process metrics would clash
        # between ranks once the sidecar merges their files. The text of generate_latest(collector),
        # written from the series text kept between renders.
        return self.collector.exposition()

    def _start_http(self, port: int, certfile: str | None, keyfile: str | None, client_cafile: str | None) -> None:
        from fsdp_mem_otel.fleet.http_server import MetricsServer, ssl_context

        try:
            ctx = ssl_context(certfile, keyfile, client_cafile) if certfile is not None and keyfile is not None \
                else None
            server = MetricsServer(self._render_registry, self.addr, port, ssl_context=ctx,
                                   banner=b"fsdp-mem-otel: metrics at /metrics\n")
            server.start()
        except OSError as exc:  # a port in use, an address or TLS file that cannot be served: one line
            self.failures.count()
            logger.error("%s", self._endpoint_failure(port, exc))
            return
        except Exception as exc:  # noqa: BLE001 - training goes on without the endpoint
            self.failures.failed("the /metrics endpoint", exc,
                                 f"cannot serve Prometheus metrics on {self.addr}:{port} (no endpoint this run)")
            return
        self._server = server
        self.port = server.port
        logger.info("fsdp_mem_otel: serving Prometheus metrics on %s:%d/metrics", self.addr, self.port)

    def _endpoint_failure(self, port: int, exc: OSError) -> str:
        """The one line that says why the endpoint is off on this rank, and what to change."""
        config, local = self.config, self.identity.local_rank
        port_var, on_var = env.FSDP_MEM_OTEL_PROMETHEUS_PORT, env.FSDP_MEM_OTEL_PROMETHEUS
        if config.port is not None:
            where = f"on {self.addr}"
        elif self._env_names:
            where = f"({port_var}={config.base_port} + LOCAL_RANK {local})"
        else:
            where = f"(base_port {config.base_port} + local rank {local})"
        if exc.errno == errno.EADDRINUSE:
            fix = (f"set {port_var} to a free base port or {on_var}=0" if self._env_names and config.port is None
                   else "pass a free port (0: any free one) or http=False")
            return (f"fsdp_mem_otel: Prometheus port {port} {where} is in use: metrics endpoint off for this rank; "
                    f"{fix}")
        fix = (f"check {env.FSDP_MEM_OTEL_PROMETHEUS_ADDR} and the FSDP_MEM_OTEL_TLS_* files, or set {on_var}=0"
               if self._env_names else "check addr and the TLS files, or pass http=False")
        return (f"fsdp_mem_otel: Prometheus endpoint {self.addr}:{port} {where} cannot be served ({exc}): metrics "
                f"endpoint off for this rank; {fix}")

    def _render_registry(self) -> bytes:
        return generate_latest(self.registry)

    def _io_error(self, where: str, exc: BaseException) -> None:
        self.failures.failed(where, exc)


class _SidecarWriter:
    """Writes the latest exposition to one file, atomically, on a background worker.

    Requests coalesce: when steps come faster than writes, only the latest report is written,
    and writes are at least ``min_interval`` seconds apart (Prometheus reads the file every scrape
    interval, not every step; a render costs 1-2.5 ms of CPU at 100 modules on a loaded 2-core
    machine, ``StepReportCollector.exposition``). An urgent request (an aborted step), a flush and
    close write at once. Between steps the worker refreshes the file's modification time
    (heartbeat). A failed write is counted each time, logged once per outage, and retried on the
    next step.
    """

    def __init__(self, directory: str, path: str, render: Callable[[], bytes], failures: FailureLog,
                 heartbeat_seconds: float = 10.0, min_interval: float = 0.0) -> None:
        self.directory = directory
        self.path = path
        self._render = render
        self._failures = failures
        self.min_interval = min_interval
        self._last_write: float | None = None
        self._cond = threading.Condition()
        self._flushing = 0
        self._urgent = False
        self._closing = False
        self._written = False
        self._ok = True
        self._dir_checked = False
        self._worker: BackgroundWorker[int] = BackgroundWorker(
            "sidecar", self._write, failures, max_items=1, coalesce=True, idle=self._touch,
            idle_seconds=heartbeat_seconds, on_closing=self._wake)

    def request(self, urgent: bool = False) -> None:
        if urgent:
            with self._cond:
                self._urgent = True
                self._cond.notify_all()
        self._worker.submit(0)

    def flush(self, timeout: float) -> bool:
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
        try:
            return self._worker.flush(timeout) and self._ok
        finally:
            with self._cond:
                self._flushing -= 1

    def close(self, timeout: float) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._worker.shutdown(timeout)

    def _wake(self) -> None:
        """The worker's own shutdown began (``close``, interpreter exit, SIGTERM): stop waiting."""
        with self._cond:
            self._cond.notify_all()

    def _wait_for_interval(self) -> None:
        """On the worker: until ``min_interval`` after the last write, unless hurried. One timed
        wait, woken by a flush, an urgent request and the worker's shutdown (no polling: at one
        step per second the worker waits out nearly every interval)."""
        if self._last_write is None:
            return
        deadline = self._last_write + self.min_interval
        with self._cond:
            while not (self._flushing or self._urgent or self._closing or self._worker.closing):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            self._urgent = False

    def _touch(self) -> None:
        # Heartbeat: a live rank whose training is stuck (e.g. in a collective with a dead peer)
        # keeps its file fresh, so the sidecar tells "process dead" (stale) from "no progress"
        # (last_step_timestamp ages). Nothing written yet, or writes failing: nothing to touch.
        if not self._written or not self._ok:
            return
        try:
            os.utime(self.path)
        except OSError as exc:
            self._failures.failed("heartbeat", exc, f"cannot touch {self.path}: {exc!r}")

    def _tighten_directory(self) -> None:
        # An existing directory (a Kubernetes emptyDir is 0777) would let other users read and
        # replace the rank files: make it owner-only when it is ours, else say so once.
        self._dir_checked = True
        st = os.stat(self.directory)
        if stat.S_IMODE(st.st_mode) & 0o077:
            if st.st_uid == os.geteuid():
                os.chmod(self.directory, _DIR_MODE)
            else:
                self._failures.warn_once(
                    "open directory", f"{self.directory} is open to other users and not this user's to tighten: "
                    "other containers can read and replace the rank files; point sidecar_dir at a subdirectory "
                    "(it is then created owner-only)")

    def _write(self, _: int) -> None:
        self._wait_for_interval()
        self._last_write = time.monotonic()
        tmp = None
        try:
            data = self._render()
            if not os.path.isdir(self.directory):
                os.makedirs(self.directory, mode=_DIR_MODE, exist_ok=True)
                os.chmod(self.directory, _DIR_MODE)  # makedirs' mode is filtered by the umask
            elif not self._dir_checked:
                self._tighten_directory()
            fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(self.path) + ".", suffix=".tmp",
                                       dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), _FILE_MODE)  # readable by a sidecar sharing the group
                f.write(data)
            os.replace(tmp, self.path)
            tmp = None
        except Exception as exc:  # noqa: BLE001 - counted, logged once per outage, retried next step
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            self._ok = False
            self._failures.failed("the sidecar file", exc, f"cannot write {self.path} (retrying every step): {exc!r}")
            return
        self._ok = self._written = True
        self._failures.recovered("the sidecar file")
