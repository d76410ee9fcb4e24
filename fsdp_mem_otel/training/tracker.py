"""The tracker: lifecycle (attach / step / detach), light and deep modes, error containment."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
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
from fsdp_mem_otel.schema import (
    DEEP,
    DEEP_SKIPPED_COMPILED,
    INPUTS,
    LIGHT,
    WARNING_NOTHING_SHARDED,
    WARNING_OPTIMIZER_NO_STATE,
    StepAbort,
    StepReport,
)
from fsdp_mem_otel.training.adapters import make_adapter
from fsdp_mem_otel.training.adapters.base import iter_tensors
from fsdp_mem_otel.training.allocator import AllocatorProbe
from fsdp_mem_otel.training.compile_support import (
    called_from_compiled_code,
    compiled_regions,
    force_eager,
    keep_out_of_dynamo,
)
from fsdp_mem_otel.training.deep import RESIZE_WATCH, DeepMode
from fsdp_mem_otel.training.ledger import Ledger
from fsdp_mem_otel.training.optimizers import OptimizerWatch, unwrap_optimizers
from fsdp_mem_otel.training.recorder import StepContext, StepRecorder
from fsdp_mem_otel.training.sink import Sink

logger = logging.getLogger(__name__)


class FSDPMemoryTracker:
    """Per-module, per-state memory of an FSDP model, for every step of a run.

    Args:
        model: a model wrapped with FSDP2 (``fully_shard``) or FSDP1 (``FullyShardedDataParallel``),
            possibly inside wrappers (torch.compile, Lightning Fabric, DDP-style ``module``).
        optimizer: its optimizer, to account optimizer state (optional). Wrappers holding the
            torch optimizer as ``.optimizer`` or ``._optimizer`` (accelerate's
            ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) are unwrapped, and
            containers holding several as ``.optimizers`` (torchtitan's ``OptimizersContainer``)
            are tracked through each of them.
        mode: "light" (default: no per-op cost) or "deep" (every op accounted).
        deep_every: with mode="light", run every Nth step deep (0 = never).
        config: a full TrackerConfig instead of mode/deep_every.
        exporters: objects with export(report)/shutdown() (see fsdp_mem_otel.exporters) that get
            every StepReport; their failures are counted and logged, never raised.

    Use ``with tracker:`` (or attach()/detach()) around the whole run and call ``step()`` once per
    training step, after ``optimizer.step()``, from the thread that attached (FSDP hooks may fire
    on autograd's threads; that is fine). Internal failures are logged once, counted in
    ``errors_total`` and never raised into training; an attach() that fails leaves every hook
    and attribute as it was. ``step()`` with no forward in between returns a report with no
    module snapshots; calling it twice in a row is harmless.
    """

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
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module wrapped with FSDP; got {type(model).__name__}")
        optimizers = unwrap_optimizers(optimizer)
        if config is not None and not isinstance(config, TrackerConfig):
            raise TypeError(f"config must be a TrackerConfig or None; got {type(config).__name__}")
        overrides = {k: v for k, v in (("mode", mode), ("deep_every", deep_every)) if v is not None}
        if config is None:
            config = TrackerConfig.from_env(None, **overrides)
        elif overrides:
            raise ValueError("pass either config or mode/deep_every, not both")
        for i, exp in enumerate(exporters):
            if not (callable(getattr(exp, "export", None)) and callable(getattr(exp, "shutdown", None))):
                raise TypeError(f"exporters[{i}] must have export(report) and shutdown(); got {type(exp).__name__}")
        self.exporters = list(exporters)
        self.config = config
        self.model = model
        self.ledger = Ledger()
        self.context = StepContext()
        self.recorder = StepRecorder(self.ledger, self.context)
        self._optimizers = OptimizerWatch(optimizers, self.ledger, self.context, self.report_error)
        self._probe = AllocatorProbe(reset_peaks=config.reset_peaks)
        self._sink = Sink(self.ledger, self.recorder, self.report_error, self._probe.sample, config.activations)
        self._sink.on_forward = self._start_pending_deep
        self._sink.on_raising_forward = self._note_raising_forward
        keep_out_of_dynamo()
        self._adapter = make_adapter(model, self._sink)
        if optimizers:
            _check_optimizer_covers_model(self._optimizers.params(), model)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.local_rank = int(os.environ.get(env.LOCAL_RANK, self.rank))

        #: the tracker's own failures and its exporters' (each kind logged once)
        self.failures = FailureLog(logger, "tracker")
        self._own_errors = 0  # errors_total without exporter failures: what max_errors limits
        self.steps_completed = 0
        #: deep steps that stayed light, by reason (``DEEP_SKIPPED_COMPILED``)
        self.deep_skipped_total: dict[str, int] = {}
        self.attached = False
        self.disabled = False
        self._owner_thread: int | None = None
        self._nothing_sharded = False
        self._deep_mode: DeepMode | None = None
        self._restore_stance: Any = None
        self._step_mode = LIGHT
        self._called_from_compiled = False  # an FSDP forward ran under a compiled caller
        self._deep_skipped: str | None = None
        self._abort: StepAbort | None = None
        self._reset_step_state()

    @classmethod
    def from_env(cls, model: nn.Module, optimizer: Any = None) -> FSDPMemoryTracker:
        """A tracker configured entirely from the environment: TrackerConfig.from_env() for how
        to measure, ExportConfig.from_env() (plus the standard OTEL_* variables) for where the
        reports go. The usual way to switch it on in a torchrun or Kubernetes job."""
        from fsdp_mem_otel.exporters import build_exporters

        config = TrackerConfig.from_env()
        tracker = cls(model, optimizer, config=config)  # validate the model before opening ports
        if config.enabled:  # FSDP_MEM_OTEL_ENABLED=0: no ports, no files, nothing measured
            tracker.exporters = list(build_exporters())
        return tracker

    # -- lifecycle -----------------------------------------------------------------------------
    def attach(self) -> FSDPMemoryTracker:
        """Install hooks; the first step starts now. Calling it twice is a no-op.

        All or nothing: if anything fails half-way, what was installed is removed again, the
        failure is logged and counted, and training goes on untracked (``attached`` stays False).
        """
        if self.attached or not self.config.enabled:
            return self
        try:
            self._install()
        except Exception as exc:  # noqa: BLE001 - a failed attach must not stop training
            self._uninstall()
            self.report_error(exc, may_disable=False)
            return self
        self.attached = self._sink.active = True
        try:
            self._adapter.start()
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        self.ledger.reset_step()
        self._probe.start()
        self._begin_step()
        return self

    def _install(self) -> None:
        self._owner_thread = threading.get_ident()
        self._adapter.attach()
        for t, category in self._adapter.persistent_tensors():
            self.ledger.track(t, category)
        self._optimizers.attach()
        self._check_sharding()

    def _uninstall(self) -> None:
        self._optimizers.detach()
        self._adapter.detach()

    def _check_sharding(self) -> None:
        if self.world_size > 1 and self._adapter.shards_nothing() and not self._nothing_sharded:
            self._nothing_sharded = True
            logger.warning(
                "fsdp_mem_otel: the model's FSDP shards nothing: every shard group has one rank in a job of %d "
                "ranks, so each rank holds the whole model (check the mesh given to FSDP; Lightning's "
                "ModelParallelStrategy needs data_parallel_size)", self.world_size)

    def detach(self) -> None:
        """Remove every hook and patch; accounting stops. Safe to call twice."""
        if not self.attached:
            return
        self.attached = self._sink.active = False
        self._leave_deep()
        self._sink.end_step()
        self._uninstall()

    def __enter__(self) -> FSDPMemoryTracker:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    @property
    def errors_total(self) -> int:
        """Internal failures so far (exporter failures included); never raised into training."""
        return self.failures.total

    @property
    def module_keys(self) -> list[str]:
        """Keys of the tracked FSDP modules, in named_modules() order."""
        return self._adapter.module_keys()

    @property
    def fsdp_version(self) -> int:
        return self._adapter.fsdp_version

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose state is accounted (unwrapped from what was passed)."""
        return self._optimizers.optimizers

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first of ``optimizers`` (the only one, unless a container was passed), or None."""
        return self._optimizers.optimizers[0] if self._optimizers.optimizers else None

    @property
    def warnings(self) -> list[str]:
        """What is wrong with the setup being measured (``schema.WARNINGS``), as in each report."""
        found = []
        if self._optimizers.no_state:
            found.append(WARNING_OPTIMIZER_NO_STATE)
        if self._nothing_sharded:
            found.append(WARNING_NOTHING_SHARDED)
        return found

    def step(self) -> StepReport:
        """Close the current step: return its report and start the next one.

        Live tensors (params, grads, optimizer state) stay accounted; module snapshots and peaks
        restart. Call it once per training step, after the optimizer step.
        """
        if self._owner_thread is not None and threading.get_ident() != self._owner_thread:
            raise RuntimeError(
                "tracker.step() must be called from the thread that called attach() (the training "
                "loop's thread): deep mode's dispatch mode is per thread"
            )
        now = time.perf_counter()
        self.steps_completed += 1
        end_ns = time.time_ns()
        report = StepReport(
            step=self.steps_completed,
            rank=self.rank,
            world_size=self.world_size,
            mode=self._step_mode,
            fsdp_version=self.fsdp_version,
            peak={},
            modules={},
            module_order=self.module_keys,
            duration_seconds=now - self._step_started,
            errors_total=self.errors_total,
            timestamp=end_ns / 1e9,
            local_rank=self.local_rank,
            start_time_ns=self._step_started_ns,
            end_time_ns=end_ns,
            deep_skipped=self._deep_skipped,
        )
        try:
            overhead = self._sink.overhead
            self._sink.end_step()  # a forward that raised before its end left hooks pushed
            if self._abort is None and self.recorder.in_pass:
                self._abort = self._make_abort(
                    "IncompleteStep", "step() called while a forward or backward pass was still open", False
                )
            report.aborted = self._abort
            self._optimizers.step_end()
            report.warnings = self.warnings
            self._adapter.reconcile()
            report.fallback_groups = self._adapter.fallback_groups
            self.recorder.close_open_windows()
            report.peak = self.ledger.step_peak()
            report.current = self.ledger.snapshot()
            report.allocator = self._probe.step_stats({d: c["total"] for d, c in report.current.items()})
            report.modules = self.recorder.modules
            report.tracker_overhead_seconds = overhead
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        report.errors_total = self.errors_total
        self._leave_deep()
        self._reset_step_state()
        self.ledger.reset_step()
        for exporter in self.exporters:
            try:
                exporter.export(report)
            except Exception as exc:  # noqa: BLE001 - an exporter must not break training
                # counted and logged, but a failing exporter does not switch measuring off
                self.report_error(exc, may_disable=False)
        if self.attached:
            self._begin_step()
        return report

    def close(self) -> None:
        """Detach and shut every exporter down (flushing what they hold). Safe to call twice."""
        self.detach()
        for exporter in self.exporters:
            try:
                exporter.shutdown()
            except Exception as exc:  # noqa: BLE001
                self.report_error(exc)

    def record_exception(self, exc: BaseException) -> None:
        """Mark the current step as stopped by ``exc`` (e.g. torch.OutOfMemoryError).

        Keeps which FSDP module and state were active and the live breakdown at this moment; the
        next ``step()`` reports them in ``StepReport.aborted`` with the step's peak so far, and
        the step after that is tracked normally. ``step_scope()`` calls this for you.
        """
        if not self.attached or self._abort is not None:
            return
        try:
            self._abort = self._make_abort(type(exc).__name__, str(exc)[:500], _is_oom(exc))
        except Exception as err:  # noqa: BLE001
            self.report_error(err)

    @contextlib.contextmanager
    def step_scope(self) -> Iterator[None]:
        """``with tracker.step_scope(): forward/backward/optimizer`` records an exception that
        escapes (then re-raises it). Call ``step()`` afterwards either way."""
        try:
            yield
        except BaseException as exc:
            self.record_exception(exc)
            raise

    def _note_raising_forward(self, exc: BaseException) -> None:
        # the sink saw a forward raise: locate the abort now, before the windows close
        if self._abort is None:
            self._abort = self._make_abort(type(exc).__name__, str(exc)[:500], _is_oom(exc))

    def _make_abort(self, error: str, message: str, oom: bool) -> StepAbort:
        module, state = self.recorder.location()
        abort = StepAbort(error, message, oom, module, state, self.ledger.snapshot())
        try:
            abort.outside_pytorch_bytes = self._probe.outside_pytorch()
        except Exception as exc:  # noqa: BLE001 - the abort itself must be kept
            self.report_error(exc)
        return abort

    @contextlib.contextmanager
    def saved_activations(self) -> Iterator[None]:
        """Light mode: account what autograd saves inside the block as activations, for work
        outside any FSDP module's forward, such as a loss computed after the model
        (``with tracker.saved_activations(): loss = loss_fn(pred, labels)``)."""
        acts = self._sink.activations
        push = self.attached and self._deep_mode is None and self.config.activations and not acts.active
        if push:
            acts.push()
        try:
            yield
        finally:
            if push:
                acts.pop()

    def track_inputs(self, obj: Any) -> None:
        """Account the tensors in ``obj`` (nested lists/tuples/dicts) as model inputs."""
        try:
            for t in iter_tensors(obj):
                self.ledger.track(t, INPUTS)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    # -- step internals ------------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self.recorder.reset()
        self._step_started = time.perf_counter()
        self._step_started_ns = time.time_ns()
        self._abort = None
        self._deep_skipped = None

    def _begin_step(self) -> None:
        step = self.steps_completed + 1
        self._step_mode = LIGHT
        self._sink.forward_pending = False
        if not self.config.is_deep(step) or self.disabled:
            return
        if self._runs_compiled_code():
            if self.config.deep_when_compiled == "skip":
                self._skip_deep()
                return
            self._enter_deep()  # deep_when_compiled="eager": the whole step runs eagerly
            return
        # Deep mode starts at the step's first FSDP forward, where a compiled caller (an outer
        # torch.compile(model), a compiled training step) shows: entered before it, the dispatch
        # mode would make dynamo run that caller eagerly, changing the run.
        self._sink.forward_pending = True

    def _skip_deep(self) -> None:
        self._step_mode = LIGHT
        self._deep_skipped = DEEP_SKIPPED_COMPILED
        self.deep_skipped_total[DEEP_SKIPPED_COMPILED] = self.deep_skipped_total.get(DEEP_SKIPPED_COMPILED, 0) + 1
        if self.deep_skipped_total[DEEP_SKIPPED_COMPILED] == 1:
            logger.warning(
                "fsdp_mem_otel: deep steps stay light on this model: it runs torch.compile'd code, which a "
                "deep step would run eagerly (set deep_when_compiled='eager' / FSDP_MEM_OTEL_DEEP_WHEN_COMPILED"
                "=eager to measure such steps eagerly)"
            )

    def _runs_compiled_code(self) -> bool:
        if self._called_from_compiled:
            return True
        try:
            return bool(compiled_regions(self.model))
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
            return True  # unsure: do not risk running compiled code eagerly

    def _start_pending_deep(self) -> None:
        """The step's first FSDP forward of a deep step: go deep, unless compiled code called it."""
        if called_from_compiled_code():
            self._called_from_compiled = True
            self._skip_deep()
        else:
            self._enter_deep()

    def _enter_deep(self) -> None:
        if self._deep_mode is not None:
            return
        try:
            if self.config.deep_when_compiled == "eager" and self._runs_compiled_code():
                self._restore_stance = force_eager()
            self._deep_mode = DeepMode(self.ledger, self.context, self.report_error)
            self._deep_mode.__enter__()
            RESIZE_WATCH.add(self.ledger)
            self.ledger.offer_on_add = False
            self._sink.deep = True
            self._step_mode = DEEP
            self._adapter.use_tensors(True)
        except Exception as exc:  # noqa: BLE001
            self._deep_mode = None
            self._restore_eager_stance()
            self.report_error(exc)

    def _restore_eager_stance(self) -> None:
        restore, self._restore_stance = self._restore_stance, None
        if restore is not None:
            try:
                restore()
            except Exception as exc:  # noqa: BLE001
                self.report_error(exc)

    def _leave_deep(self) -> None:
        mode, self._deep_mode = self._deep_mode, None
        if mode is None:
            return
        self.ledger.offer_on_add = True
        self._sink.deep = False
        RESIZE_WATCH.discard(self.ledger)
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if _get_current_dispatch_mode() is not mode:
                raise RuntimeError(
                    "deep-mode dispatch mode is not the innermost active mode at step(); "
                    "call tracker.step() outside any other TorchDispatchMode, on the training thread"
                )
            mode.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        try:
            self._adapter.use_tensors(False)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        self._restore_eager_stance()

    def report_error(self, exc: BaseException, may_disable: bool = True) -> None:
        """Count an internal failure, log it once per kind, and detach after too many
        (``max_errors``) of the tracker's own; exporter failures pass ``may_disable=False``."""
        self.failures.failed(f"{type(exc).__name__} at {_origin(exc)}", exc, repr(exc))
        if may_disable:
            self._own_errors += 1
        limit = self.config.max_errors
        if limit and self._own_errors >= limit and not self.disabled:
            self.disabled = True
            logger.error("fsdp_mem_otel: %d internal errors, the tracker detached itself (training continues)",
                         self.errors_total)
            try:
                self.detach()
            except Exception:  # noqa: BLE001
                logger.exception("fsdp_mem_otel: detach after errors failed")


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _origin(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"


def _check_optimizer_covers_model(opt_params: list[torch.Tensor], model: nn.Module) -> None:
    model_params = {id(p) for p in model.parameters()}
    if opt_params and not any(id(p) in model_params for p in opt_params):
        raise ValueError(
            "optimizer does not optimize any parameter of model; pass the optimizer built from "
            "model.parameters() after wrapping with FSDP"
        )
