"""The tracker's public lifecycle (attach, step, detach, close, from_env), composing the adapter and hot path
(``sink.py``), ``deep_steps.py``, ``optimizers.py`` and ``containment.py`` into a ``StepReport`` per step."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

try:
    import torch
    import torch.distributed as dist
    from torch import nn
except ImportError as _missing:
    from fsdp_mem_otel import MISSING_TORCH

    raise ImportError(MISSING_TORCH) from _missing

from fsdp_mem_otel import env
from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.exporters import Exporter
from fsdp_mem_otel.failures import FailureLog
from fsdp_mem_otel.schema import INPUTS, WARNING_NOTHING_SHARDED, WARNING_OPTIMIZER_NO_STATE, StepReport, breakdown_of
from fsdp_mem_otel.training.adapters import make_adapter
from fsdp_mem_otel.training.adapters.base import iter_tensors
from fsdp_mem_otel.training.allocator import AllocatorProbe, resolve_reset_peaks
from fsdp_mem_otel.training.allocator_temps import allocator_temps
from fsdp_mem_otel.training.compile_support import keep_out_of_dynamo
from fsdp_mem_otel.training.containment import ErrorPolicy, StepAborts
from fsdp_mem_otel.training.deep_steps import DeepSteps
from fsdp_mem_otel.training.leaks import LeakWatch
from fsdp_mem_otel.training.light.counters import totals_of
from fsdp_mem_otel.training.light.ledger import Ledger
from fsdp_mem_otel.training.light.recorder import StepContext, StepRecorder
from fsdp_mem_otel.training.light.sink import Sink
from fsdp_mem_otel.training.optimizers import OptimizerWatch, unwrap_optimizers
from fsdp_mem_otel.training.torch_range import WARNING_TORCH_UNTESTED, check_torch

logger = logging.getLogger(__name__)
_TRACKERS: weakref.WeakSet[FSDPMemoryTracker] = weakref.WeakSet()
NOTHING_SHARDED = (
    "fsdp_mem_otel: the model's FSDP shards nothing: every shard group has one rank in a job of %d ranks, so "
    "each rank holds the whole model (check the mesh given to FSDP; Lightning's ModelParallelStrategy needs "
    "data_parallel_size)")


class FSDPMemoryTracker:
    """Per-module, per-state memory of an FSDP model, for every step of a run.

    Args:
        model: a model wrapped with FSDP2 (``fully_shard``) or FSDP1 (``FullyShardedDataParallel``), possibly
            inside wrappers (torch.compile, Lightning Fabric, DDP-style ``module``).
        optimizer: its optimizer (optional), for optimizer state; wrappers (``.optimizer`` / ``._optimizer``:
            accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) are unwrapped, containers
            (``.optimizers``: torchtitan's ``OptimizersContainer``) tracked through each.
        mode: "light" (default: no per-op cost) or "deep" (every op accounted).
        deep_every: with mode="light", run every Nth step deep (0 = never).
        config: a full TrackerConfig instead of mode/deep_every.
        exporters: objects with export(report)/shutdown() (fsdp_mem_otel.exporters) given every StepReport.

    Use ``with tracker:`` (or attach()/detach()) around the whole run and call ``step()`` once per training step,
    after ``optimizer.step()``, from the thread that attached. Internal failures (exporters' too) are logged once,
    counted in ``errors_total`` and never raised into training; a failed attach() changes nothing. ``step()`` with
    no forward in between reports no module snapshots."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        *,
        mode: str | None = None,
        deep_every: int | None = None,
        config: TrackerConfig | None = None,
        exporters: Sequence[Exporter] = (),
    ) -> None:
        config = _checked(model, mode, deep_every, config, exporters)
        optimizers = unwrap_optimizers(optimizer)
        self.exporters = list(exporters)
        self.config, self.model = config, model
        self._errors = ErrorPolicy(config.max_errors, self.detach)
        self.ledger = Ledger()
        self.context = StepContext()
        self.recorder = StepRecorder(self.ledger, self.context)
        self._optimizers = OptimizerWatch(optimizers, self.ledger, self.context, self.report_error)
        self._probe = AllocatorProbe(reset_peaks=resolve_reset_peaks(config.reset_peaks))  # None: where CUDA is
        self.ledger.watch_windows(allocator_temps(self._probe, self._probe.reset_peaks))  # defers unless watched
        self._sink = Sink(self.ledger, self.recorder, self.report_error, self._probe.sampler, config)
        self._aborts = StepAborts(self.recorder, self.ledger, self._probe, self.report_error)
        self._leaks = LeakWatch(config.leak_window)
        self._sink.on_raising_forward = self._aborts.record
        keep_out_of_dynamo()
        self._adapter = make_adapter(model, self._sink)
        self._deep = DeepSteps(config, model, self.ledger, self.context, self._sink, self._adapter, self.report_error)
        self._module_order = self._adapter.module_keys()  # as each report has them; an FSDP1 attach looks again
        if optimizers:
            _check_optimizer_covers_model(self._optimizers.params(), model)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        self.local_rank = int(os.environ.get(env.LOCAL_RANK, self.rank))
        self.steps_completed, self.attached = 0, False
        self._owner_thread: int | None = None
        self._nothing_sharded = self._untested_torch = False
        self._start_step()
        _TRACKERS.add(self)  # for attached_trackers()

    @classmethod
    def from_env(cls, model: nn.Module, optimizer: Any = None) -> FSDPMemoryTracker:
        """A tracker configured from the environment (TrackerConfig.from_env(), ExportConfig.from_env(), OTEL_*):
        the usual switch in a torchrun or Kubernetes job."""
        from fsdp_mem_otel.exporters import build_exporters

        config = TrackerConfig.from_env()
        tracker = cls(model, optimizer, config=config)  # validate the model before opening ports
        if config.enabled:  # FSDP_MEM_OTEL_ENABLED=0: no ports, no files, nothing measured
            tracker.exporters = list(build_exporters())
        return tracker

    # -- lifecycle -----------------------------------------------------------------------------
    def attach(self) -> FSDPMemoryTracker:
        """Install hooks; the first step starts now. All or nothing: a failure removes what was installed, is
        logged and counted, and training goes on untracked."""
        if self.attached or not self.config.enabled:
            return self
        try:
            self._owner_thread = threading.get_ident()
            self._adapter.attach()
            self._module_order = self._adapter.module_keys()
            for t, category in self._adapter.persistent_tensors():
                self.ledger.track(t, category)
            self._optimizers.attach()
            if self.world_size > 1 and self._adapter.shards_nothing():
                self._nothing_sharded = True
                logger.warning(NOTHING_SHARDED, self.world_size)
        except Exception as exc:  # noqa: BLE001 - a failed attach must not stop training
            self._optimizers.detach()
            self._adapter.detach()
            self.report_error(exc, may_disable=False)
            return self
        self.attached = self._sink.active = True
        try:
            self._adapter.start()
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        self.ledger.reset_step()
        self._untested_torch = check_torch()  # logged once per process
        self._probe.start()
        self._deep.begin(self.steps_completed + 1, not self.disabled)
        return self

    def detach(self) -> None:
        """Remove every hook and patch; accounting stops. Safe to call twice."""
        if not self.attached:
            return
        self.attached = self._sink.active = False
        self._deep.end()
        self._sink.end_step()
        self._optimizers.detach()
        self._adapter.detach()
        self._probe.stop()  # the last tracker puts torch's peak readers back

    def close(self) -> None:
        """Detach and shut every exporter down (flushing what they hold). Safe to call twice."""
        self.detach()
        for exporter in self.exporters:
            try:
                exporter.shutdown()
            except Exception as exc:  # noqa: BLE001
                self.report_error(exc)

    def __enter__(self) -> FSDPMemoryTracker:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def step(self) -> StepReport:
        """Close the current step: its report. Live tensors stay accounted; snapshots and peaks restart. Call once
        per training step, after the optimizer step."""
        if self._owner_thread is not None and threading.get_ident() != self._owner_thread:
            raise RuntimeError(
                "tracker.step() must be called from the thread that called attach() (the training "
                "loop's thread): deep mode's dispatch mode is per thread"
            )
        self.steps_completed += 1
        end_ns = time.time_ns()
        report = StepReport(
            step=self.steps_completed, rank=self.rank, world_size=self.world_size, mode=self._deep.step_mode,
            fsdp_version=self._adapter.fsdp_version, peak={}, modules={},
            duration_seconds=time.perf_counter() - self._step_started,
            timestamp=end_ns / 1e9, local_rank=self.local_rank, start_time_ns=self._step_started_ns,
            end_time_ns=end_ns, deep_skipped=self._deep.skipped,
        )
        later: dict[str, Any] = {"module_order": self._module_order.copy}  # fields built when read (exporters' threads)
        try:
            report.tracker_overhead_seconds = self._sink.overhead
            self._sink.end_step()  # a forward that raised before its end left hooks pushed
            self._aborts.incomplete()
            report.aborted = self._aborts.take()
            self._optimizers.step_end()
            report.warnings = self.warnings
            self._adapter.reconcile()
            report.fallback_groups = self._adapter.fallback_groups
            self.recorder.close_open_windows()
            now, later["peak"] = self.ledger.step_end_later()
            later["current"] = functools.partial(breakdown_of, now)
            later["leak"] = self._leaks.observe_later(now, self.ledger.owner_bytes)
            report.allocator = self._probe.step_stats(totals_of(now))
            later["modules"] = self.recorder.modules_later()
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        report.fill_later(functools.partial(_failed_later, weakref.ref(self)), **later)  # what was taken
        report.errors_total = self._errors.total  # the step's own failures included
        self._deep.end()
        self._start_step()
        self.ledger.reset_step()
        for exporter in self.exporters:
            try:
                exporter.export(report)
            except Exception as exc:  # noqa: BLE001 - an exporter must not break training
                self.report_error(exc, may_disable=False)  # counted; measuring stays on
        if self.attached:
            self._deep.begin(self.steps_completed + 1, not self._errors.disabled)
        return report

    def _start_step(self) -> None:
        self.recorder.reset()
        self._aborts.take()
        self._step_started, self._step_started_ns = time.perf_counter(), time.time_ns()

    # -- what training code calls besides step() -------------------------------------------------
    def track_inputs(self, obj: Any) -> None:
        """Account the tensors in ``obj`` (nested lists/tuples/dicts) as model inputs."""
        try:
            for t in iter_tensors(obj):
                self.ledger.track(t, INPUTS)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    @contextlib.contextmanager
    def saved_activations(self) -> Iterator[None]:
        """Light mode: what autograd saves in the block counts as activations (e.g. computing the loss)."""
        acts = self._sink.scoped_activations
        pushed = self.attached and not self._deep.active and self.config.activations and acts.push()
        try:
            yield
        finally:
            if pushed:
                acts.pop()

    def add_optimizer(self, optimizer: Any) -> None:
        """Also track ``optimizer`` (unwrapped as the constructor's): one found after attach."""
        self._optimizers.add(unwrap_optimizers(optimizer), self.attached)

    def record_exception(self, exc: BaseException) -> None:
        """Mark the current step as stopped by ``exc`` (e.g. torch.OutOfMemoryError): the FSDP module, state and
        live breakdown now go into the next ``StepReport.aborted``. ``step_scope()`` calls this for you."""
        if self.attached:
            try:
                self._aborts.record(exc)
            except Exception as err:  # noqa: BLE001
                self.report_error(err)

    @contextlib.contextmanager
    def step_scope(self) -> Iterator[None]:
        """``with tracker.step_scope():`` records an escaping exception (re-raised); call ``step()`` anyway."""
        try:
            yield
        except BaseException as exc:
            self.record_exception(exc)
            raise

    def report_error(self, exc: BaseException, may_disable: bool = True) -> None:
        """Count an internal failure, log each kind once, detach after ``max_errors`` of the tracker's own."""
        self._errors.report(exc, may_disable)

    # -- state: errors, self-disabling, skipped deep steps, module keys, optimizers (``optimizer``: the first)
    errors_total = property(lambda self: self._errors.total)
    failures: FailureLog = property(lambda self: self._errors.failures)  # type: ignore[assignment]
    disabled = property(lambda self: self._errors.disabled)
    deep_skipped_total = property(lambda self: self._deep.skipped_total)
    module_keys = property(lambda self: self._adapter.module_keys())
    fsdp_version = property(lambda self: self._adapter.fsdp_version)
    optimizers = property(lambda self: self._optimizers.optimizers)
    optimizer = property(lambda self: next(iter(self._optimizers.optimizers), None))
    warnings: list[str] = property(lambda self: _setup_warnings(self))  # type: ignore[assignment]


def _setup_warnings(tracker: FSDPMemoryTracker) -> list[str]:
    """What is wrong with the setup ``tracker`` measures (``schema.WARNINGS``; ``WARNING_TORCH_UNTESTED``)."""
    flags = ((WARNING_OPTIMIZER_NO_STATE, tracker._optimizers.no_state),
             (WARNING_NOTHING_SHARDED, tracker._nothing_sharded), (WARNING_TORCH_UNTESTED, tracker._untested_torch))
    return [kind for kind, on in flags if on]


def attached_trackers() -> list[FSDPMemoryTracker]:
    """Every attached tracker of this process (``fsdp_mem_otel.run`` leaves a model a tracker measures to it)."""
    return [t for t in list(_TRACKERS) if t.attached]


def _checked(model: nn.Module, mode: str | None, deep_every: int | None, config: TrackerConfig | None,
             exporters: Sequence[Exporter]) -> TrackerConfig:
    """The tracker's arguments checked (errors name the argument); its config."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module wrapped with FSDP; got {type(model).__name__}")
    if config is not None and not isinstance(config, TrackerConfig):
        raise TypeError(f"config must be a TrackerConfig or None; got {type(config).__name__}")
    overrides = {k: v for k, v in (("mode", mode), ("deep_every", deep_every)) if v is not None}
    if config is not None and overrides:
        raise ValueError("pass either config or mode/deep_every, not both")
    for i, exp in enumerate(exporters):
        if not (callable(getattr(exp, "export", None)) and callable(getattr(exp, "shutdown", None))):
            raise TypeError(f"exporters[{i}] must have export(report) and shutdown(); got {type(exp).__name__}")
    return config if config is not None else TrackerConfig.from_env(None, **overrides)


def _failed_later(tracker: weakref.ref[FSDPMemoryTracker], exc: Exception) -> None:
    """A report's field built when read failed: counted, not towards detaching (the tracker held weakly)."""
    counting = tracker()
    if counting is not None:
        counting.report_error(exc, may_disable=False)


def _check_optimizer_covers_model(opt_params: list[torch.Tensor], model: nn.Module) -> None:
    model_params = {id(p) for p in model.parameters()}
    if opt_params and not any(id(p) in model_params for p in opt_params):
        raise ValueError(
            "optimizer does not optimize any parameter of model; pass the optimizer built from "
            "model.parameters() after wrapping with FSDP"
        )
