"""What the framework callbacks and the launcher share: start a tracker safely, account forward
inputs, stop; and what a job configured from the environment is told.

A tracker configured from the environment (no config and no exporters from code) reads it with
``config.read_env``: a variable whose value is not accepted is said in one line, once per process
and on rank 0 only (``RANK``), and switches off only what it configures; training always goes on.
``announcement`` and ``summary`` are the lines ``fsdp_mem_otel.run`` prints on rank 0 when the
tracker attaches and at exit (``FSDP_MEM_OTEL_QUIET=1`` silences those two, never a mistake).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from fsdp_mem_otel import env
from fsdp_mem_otel.config import BadSetting, EnvSettings, TrackerConfig, read_env
from fsdp_mem_otel.exporters import Exporter
from fsdp_mem_otel.schema import StepReport

logger = logging.getLogger(__name__)
OnReport = Callable[[StepReport], None]
#: the lines about bad settings this process said (each once)
_SAID: set[str] = set()


def env_rank() -> int:
    """This process's rank as torchrun sets it (``RANK``; 0 when unset or not a number)."""
    try:
        return int(os.environ.get(env.RANK, "") or 0)
    except ValueError:
        return 0


def say_bad_settings(bad: Sequence[BadSetting]) -> None:
    """Log each bad setting's line once per process, on rank 0 only (one line for the job)."""
    if env_rank() != 0:
        return
    for setting in bad:
        line = setting.line()
        if line not in _SAID:
            _SAID.add(line)
            logger.warning("%s", line)


def say(line: str) -> None:
    """Print one line to stderr: what the launcher says must show with logging left unconfigured.
    One write (``print`` makes two, which other ranks' lines can come between when unbuffered)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class TrackingSession:
    """One tracker for one training run, started when the framework's model is ready.

    ``start`` never raises into training: a model the tracker refuses (say, a framework that did
    not apply FSDP) logs why and leaves the session off. Without a config and exporters from code
    it is configured from the environment (``read_env``; ``settings`` keeps what it read).
    """

    def __init__(self, config: TrackerConfig | None, exporters: Sequence[Exporter] | None,
                 on_report: OnReport | None) -> None:
        if config is not None and not isinstance(config, TrackerConfig):
            raise TypeError(f"config must be a TrackerConfig or None; got {type(config).__name__}")
        if on_report is not None and not callable(on_report):
            raise TypeError(f"on_report must be callable (report -> None) or None; got {type(on_report).__name__}")
        self._config = config
        self._exporters = exporters
        self._on_report = on_report
        self.tracker: Any = None
        self.settings: EnvSettings | None = None  # what the environment said, when it configured the tracker
        self.failed: str | None = None  # why the session did not start
        self._input_hook: Any = None

    @property
    def active(self) -> bool:
        return self.tracker is not None and self.tracker.attached

    @property
    def switched_off(self) -> bool:
        """The tracker was built with tracking off (``FSDP_MEM_OTEL_ENABLED``): nothing to attach."""
        return self.tracker is not None and not self.tracker.config.enabled

    def start(self, model: nn.Module, optimizer: Any, *, watch_inputs: bool) -> None:
        """Build and attach the tracker (once); ``watch_inputs``: account every forward's
        arguments of ``model`` as inputs (for frameworks that never show callbacks the batch)."""
        if self.tracker is not None or self.failed is not None:
            return
        from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

        try:
            if self._config is None and self._exporters is None:
                tracker = self._from_env(model, optimizer)
            else:
                tracker = FSDPMemoryTracker(model, optimizer, config=self._config, exporters=self._exporters or ())
        except (TypeError, ValueError) as exc:
            self.failed = str(exc)
            logger.error("fsdp_mem_otel: memory tracking is off for this run: %s", exc)
            return
        self.tracker = tracker.attach()
        if watch_inputs:
            self._input_hook = model.register_forward_pre_hook(self._on_forward, with_kwargs=True, prepend=True)

    def _from_env(self, model: nn.Module, optimizer: Any) -> Any:
        """``FSDPMemoryTracker.from_env``, forgiving: each bad setting said once, its part off."""
        from fsdp_mem_otel.exporters import build_exporters
        from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

        settings = self.settings = read_env()
        say_bad_settings(settings.bad)
        tracker = FSDPMemoryTracker(model, optimizer, config=settings.tracker)  # the model checked before ports open
        if settings.tracker.enabled:  # FSDP_MEM_OTEL_ENABLED=0: no ports, no files, nothing measured
            tracker.exporters = list(build_exporters(settings.export, from_env=True))
        return tracker

    def _on_forward(self, _module: nn.Module, args: Any, kwargs: Any) -> None:
        self.tracker.track_inputs((args, kwargs))

    def track_inputs(self, batch: Any) -> None:
        if self.active:
            self.tracker.track_inputs(batch)

    def step(self) -> StepReport | None:
        """Close the tracker's step (one optimizer step); hands the report to ``on_report``."""
        if self.tracker is None:
            return None
        report = self.tracker.step()
        if self._on_report is not None:
            try:
                self._on_report(report)
            except Exception:  # noqa: BLE001 - the user's callback must not stop training
                logger.exception("fsdp_mem_otel: on_report raised (training continues)")
        return report

    def close(self) -> None:
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None
        if self.tracker is not None:
            self.tracker.close()

    # -- what a launched job is told (rank 0) ----------------------------------------------------
    @property
    def speaks(self) -> bool:
        """Whether this process says the announcement and the summary: rank 0, configured from
        the environment, not ``FSDP_MEM_OTEL_QUIET``."""
        return (self.tracker is not None and self.settings is not None and not self.settings.quiet
                and self.tracker.rank == 0)

    def announcement(self, root: str) -> str:
        """``fsdp_mem_otel: tracking Net (FSDP2, 3 modules) in light mode; Prometheus
        http://0.0.0.0:9400/metrics (base port, + LOCAL_RANK per rank), JSONL /tmp/run.rank{0..1}.jsonl,
        spans off``: what is measured, how, and where every report goes."""
        tracker = self.tracker
        config = tracker.config
        mode = "deep mode" if config.mode == "deep" else (
            f"light mode, deep every {config.deep_every} steps" if config.deep_every else "light mode")
        n = len(tracker.module_keys)
        return (f"fsdp_mem_otel: tracking {root} (FSDP{tracker.fsdp_version}, {n} module{'s' if n != 1 else ''}) "
                f"in {mode}; {', '.join(self._destinations(tracker.world_size))}")

    def _destinations(self, world: int) -> list[str]:
        exporters = self.tracker.exporters
        ranks = f"{{0..{world - 1}}}" if world > 1 else "0"
        prom = _of_kind(exporters, "PrometheusExporter")
        out = []
        if prom is not None and prom.port is not None:
            scheme = "https" if prom.config.certfile else "http"
            per_rank = " (base port, + LOCAL_RANK per rank)" if prom.config.port is None else ""
            out.append(f"Prometheus {scheme}://{prom.addr}:{prom.port}/metrics{per_rank}")
        elif prom is not None and prom.config.http:
            out.append(f"Prometheus endpoint off on rank {self.tracker.rank} (see above)")
        else:
            out.append("Prometheus off")
        if prom is not None and prom.sidecar_path is not None:
            out.append(f"sidecar {os.path.join(prom.config.sidecar_dir, f'rank-{ranks}.prom')}")
        export = self.settings.export if self.settings is not None else None
        if _of_kind(exporters, "JSONLExporter") is not None and export is not None and export.jsonl:
            out.append(f"JSONL {export.jsonl_path(ranks, world)}")
        else:
            out.append("JSONL off")
        if _of_kind(exporters, "OTelSpanExporter") is not None:
            endpoint = (os.environ.get(env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
                        or os.environ.get(env.OTEL_EXPORTER_OTLP_ENDPOINT))
            out.append(f"spans to {endpoint}" if endpoint else "spans to stdout")
        else:
            out.append("spans off")
        return out

    def summary(self) -> str:
        """``fsdp_mem_otel: 12 step reports on rank 0: Prometheus :9400, JSONL /tmp/run.rank0.jsonl;
        0 tracker errors``: how many reports this rank closed, where they went (with each
        exporter's failures, if any), and the tracker's own errors."""
        tracker = self.tracker
        went = []
        for exporter in tracker.exporters:
            kind = type(exporter).__name__
            if kind == "PrometheusExporter":
                where = [f"Prometheus :{exporter.port}"] if exporter.port is not None else []
                where += [f"sidecar {exporter.sidecar_path}"] if exporter.sidecar_path is not None else []
            elif kind == "JSONLExporter":
                where = [f"JSONL {exporter.path}"]
            elif kind == "OTelSpanExporter":
                where = ["spans"]
            else:
                where = [kind]
            errors = getattr(exporter, "errors_total", 0)
            if where and errors:
                where[-1] += f" ({errors} error{'s' if errors != 1 else ''})"
            went += where
        n, errors = tracker.steps_completed, tracker.errors_total
        on = f" on rank {tracker.rank}" if tracker.world_size > 1 else ""
        return (f"fsdp_mem_otel: {n} step report{'s' if n != 1 else ''}{on}: {', '.join(went) or 'no exporter'}; "
                f"{errors} tracker error{'s' if errors != 1 else ''}")


def _of_kind(exporters: Sequence[Any], kind: str) -> Any:
    """The first exporter of class ``kind`` (by name: the exporters' modules load only when used)."""
    return next((e for e in exporters if type(e).__name__ == kind), None)
