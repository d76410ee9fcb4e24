"""The tracker: lifecycle (attach / step / detach), light and deep modes, error containment."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_mem_otel.adapters import make_adapter
from fsdp_mem_otel.adapters.base import iter_tensors
from fsdp_mem_otel.allocator import AllocatorProbe
from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.deep import RESIZE_WATCH, DeepMode
from fsdp_mem_otel.exporters import Exporter
from fsdp_mem_otel.ledger import Ledger
from fsdp_mem_otel.model import (
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    AFTER_PRE_BACKWARD,
    AFTER_PRE_FORWARD,
    BEFORE_POST_BACKWARD,
    BEFORE_POST_FORWARD,
    BEFORE_PRE_BACKWARD,
    BEFORE_PRE_FORWARD,
    DEEP,
    INPUTS,
    LIGHT,
    OPTIMIZER_STATE,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    POST_FORWARD_AC,
    PRE_FORWARD_AC,
    ModuleReport,
    StepAbort,
    StepReport,
)

logger = logging.getLogger("fsdp_mem_otel")

# FSDP phase after each state; deep mode labels collectives by phase (as upstream does).
_PHASE_AFTER = {
    BEFORE_PRE_FORWARD: "pre_forward",
    AFTER_PRE_FORWARD: "forward",
    BEFORE_POST_FORWARD: "post_forward",
    AFTER_POST_FORWARD: "forward",
    BEFORE_PRE_BACKWARD: "pre_backward",
    AFTER_PRE_BACKWARD: "backward",
    BEFORE_POST_BACKWARD: "post_backward",
    AFTER_POST_BACKWARD: "post_backward",  # upstream keeps POST_BW until the next pre-backward
}
_OPENS = {BEFORE_PRE_FORWARD: PEAK_FORWARD, BEFORE_PRE_BACKWARD: PEAK_BACKWARD}
_CLOSES = {AFTER_POST_FORWARD: PEAK_FORWARD, AFTER_POST_BACKWARD: PEAK_BACKWARD}
_in_backward = torch._C._current_graph_task_id


class FSDPMemoryTracker:
    """Per-module, per-state memory of an FSDP model, for every step of a run.

    Args:
        model: a model wrapped with FSDP2 (``fully_shard``) or FSDP1 (``FullyShardedDataParallel``).
        optimizer: its optimizer, to account optimizer state (optional).
        mode: "light" (default: no per-op cost) or "deep" (every op accounted).
        deep_every: with mode="light", run every Nth step deep (0 = never).
        config: a full TrackerConfig instead of mode/deep_every.
        exporters: objects with export(report)/shutdown() (see fsdp_mem_otel.exporters) that get
            every StepReport; their failures are counted and logged, never raised.

    Use ``with tracker:`` (or attach()/detach()) around the whole run and call ``step()`` once per
    training step, after ``optimizer.step()``, from the thread that attached (FSDP hooks may fire
    on autograd's threads; that is fine). Internal failures are logged once, counted in
    ``errors_total`` and never raised into training. ``step()`` with no forward in between
    returns a report with no module snapshots; calling it twice in a row is harmless.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        mode: str | None = None,
        deep_every: int | None = None,
        config: TrackerConfig | None = None,
        exporters: Sequence[Exporter] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module wrapped with FSDP; got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__name__}")
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
        self.optimizer = optimizer
        self.ledger = Ledger()
        self._adapter = make_adapter(model, self)
        self._probe = AllocatorProbe(reset_peaks=config.reset_peaks)
        if optimizer is not None:
            _check_optimizer_covers_model(optimizer, model)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))

        # What FSDP is doing now: read per op by deep mode.
        self.phase = "idle"
        self.in_optimizer = False
        self.in_ac_recompute = False
        self._ac_key: str | None = None

        self.errors_total = 0
        self._own_errors = 0  # errors_total without exporter failures: what max_errors limits
        self.steps_completed = 0
        self.attached = False
        self.disabled = False
        self._logged_errors: set[str] = set()
        self._owner_thread: int | None = None
        self._opt_handles: list[Any] = []
        self._opt_tensors: dict[int, weakref.ref[torch.Tensor]] = {}
        self._deep_mode: DeepMode | None = None
        self._abort: StepAbort | None = None
        self._last_state: tuple[str, str] | None = None  # (module key, state) of the last snapshot
        self._module_last_state: dict[str, str] = {}
        self._reset_step_state()

    @classmethod
    def from_env(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> FSDPMemoryTracker:
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
        """Install hooks; the first step starts now. Calling it twice is a no-op."""
        if self.attached or not self.config.enabled:
            return self
        self._owner_thread = threading.get_ident()
        self._adapter.attach()
        for t, category in self._adapter.persistent_tensors():
            self.ledger.track(t, category)
        if self.optimizer is not None:
            self._track_optimizer_state()
            self._opt_handles = [
                self.optimizer.register_step_pre_hook(self._on_optimizer_pre),
                self.optimizer.register_step_post_hook(self._on_optimizer_post),
            ]
        self.attached = True
        self.ledger.reset_step()
        try:
            self._probe.start()
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        self._begin_step()
        return self

    def detach(self) -> None:
        """Remove every hook and patch; accounting stops. Safe to call twice."""
        if not self.attached:
            return
        self.attached = False
        self._leave_deep()
        for h in self._opt_handles:
            h.remove()
        self._opt_handles = []
        self._adapter.detach()

    def __enter__(self) -> FSDPMemoryTracker:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    @property
    def module_keys(self) -> list[str]:
        """Keys of the tracked FSDP modules, in named_modules() order."""
        return self._adapter.module_keys()

    @property
    def fsdp_version(self) -> int:
        return self._adapter.fsdp_version

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
        )
        try:
            if self._abort is None and self._windows:
                self._abort = self._make_abort(
                    "IncompleteStep", "step() called while a forward or backward pass was still open", False
                )
            report.aborted = self._abort
            self._close_open_windows()
            report.peak = self.ledger.step_peak()
            report.current = self.ledger.snapshot()
            report.allocator = self._probe.step_stats({d: c["total"] for d, c in report.current.items()})
            report.modules = self._modules
            report.tracker_overhead_seconds = self._overhead
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

    def _make_abort(self, error: str, message: str, oom: bool) -> StepAbort:
        # The innermost open forward/backward window is the module that was running.
        if self._windows:
            key = self._windows[-1][0]
        elif self._last_state is not None:
            key = self._last_state[0]
        else:
            key = ""
        state = self._module_last_state.get(key, "")
        return StepAbort(error, message, oom, key, state, self.ledger.snapshot())

    def track_inputs(self, obj: Any) -> None:
        """Account the tensors in ``obj`` (nested lists/tuples/dicts) as model inputs."""
        try:
            for t in iter_tensors(obj):
                self.ledger.track(t, INPUTS)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    # -- step internals ------------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self._modules: dict[str, ModuleReport] = {}
        self._windows: list[tuple[str, str]] = []  # (module key, peak state) per open window
        self._overhead = 0.0
        self._step_started = time.perf_counter()
        self._step_started_ns = time.time_ns()
        self.phase = "idle"
        self.in_ac_recompute = False
        self._ac_key = None
        self._abort = None
        self._last_state = None
        self._module_last_state = {}

    def _begin_step(self) -> None:
        step = self.steps_completed + 1
        deep = self.config.is_deep(step) and not self.disabled
        self._step_mode = DEEP if deep else LIGHT
        if deep:
            self._enter_deep()

    def _enter_deep(self) -> None:
        if self._deep_mode is not None:
            return
        try:
            self._deep_mode = DeepMode(self)
            self._deep_mode.__enter__()
            RESIZE_WATCH.add(self.ledger)
            self.ledger.offer_on_add = False
        except Exception as exc:  # noqa: BLE001
            self._deep_mode = None
            self.report_error(exc)

    def _leave_deep(self) -> None:
        mode, self._deep_mode = self._deep_mode, None
        if mode is None:
            return
        self.ledger.offer_on_add = True
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

    def _close_open_windows(self) -> None:
        while self._windows:
            key, peak_state = self._windows.pop()
            self._append(key, peak_state, self.ledger.close_window())

    def _append(self, key: str, state: str, snap: dict[str, dict[str, int]]) -> None:
        self._last_state = (key, state)
        self._module_last_state[key] = state
        mod = self._modules.get(key)
        if mod is None:
            mod = self._modules[key] = ModuleReport()
        calls = mod.snapshots.get(state)
        if calls is None:
            calls = mod.snapshots[state] = []
            mod.times[state] = []
        calls.append(snap)
        mod.times[state].append(time.time_ns())

    # -- EventSink (called by adapters from FSDP hooks) ---------------------------------------
    def on_state(self, key: str, state: str) -> None:
        """Module ``key`` reached ``state``: take a snapshot, open or close its peak window."""
        if not self.attached:
            return
        t0 = time.perf_counter()
        try:
            if _in_backward() != -1 and state in (
                BEFORE_PRE_FORWARD,
                AFTER_PRE_FORWARD,
                BEFORE_POST_FORWARD,
                AFTER_POST_FORWARD,
            ):
                self._on_recompute(key, state)
            else:
                self._probe.sample()
                self.phase = _PHASE_AFTER[state]
                if state in _CLOSES:
                    self._close_window(key, _CLOSES[state])
                self._append(key, state, self.ledger.snapshot())
                if state in _OPENS:
                    self.ledger.open_window()
                    self._windows.append((key, _OPENS[state]))
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        self._overhead += time.perf_counter() - t0

    def _on_recompute(self, key: str, state: str) -> None:
        # Forward hooks firing inside backward: activation-checkpoint recompute.
        if state == BEFORE_PRE_FORWARD:
            self.phase = "pre_forward"
        elif state == AFTER_PRE_FORWARD:
            self.phase = "forward"
            self._append(key, PRE_FORWARD_AC, self.ledger.snapshot())
            if self._ac_key is None:
                self._ac_key, self.in_ac_recompute = key, True
        elif state == BEFORE_POST_FORWARD:
            self.phase = "post_forward"
            self._append(key, POST_FORWARD_AC, self.ledger.snapshot())
            if self._ac_key == key:
                self._ac_key, self.in_ac_recompute = None, False

    def _close_window(self, key: str, peak_state: str) -> None:
        # Windows nest; if FSDP closes one out of order, close the inner ones first.
        if not any(k == key and s == peak_state for k, s in self._windows):
            return
        while self._windows:
            k, s = self._windows.pop()
            self._append(k, s, self.ledger.close_window())
            if k == key and s == peak_state:
                return

    def track(self, tensor: torch.Tensor | None, category: str) -> None:
        if tensor is None or not self.attached:
            return
        try:
            self.ledger.track(tensor, category)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    def refresh(self, tensor: torch.Tensor | None) -> None:
        if tensor is None or not self.attached:
            return
        try:
            self.ledger.refresh(tensor)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    def report_error(self, exc: BaseException, may_disable: bool = True) -> None:
        """Count an internal failure, log it once per kind, and detach after too many
        (``max_errors``) of the tracker's own; exporter failures pass ``may_disable=False``."""
        self.errors_total += 1
        where = f"{type(exc).__name__}@{_origin(exc)}"
        if where not in self._logged_errors:
            self._logged_errors.add(where)
            logger.error("fsdp_mem_otel internal error (training continues): %r", exc, exc_info=exc)
        if may_disable:
            self._own_errors += 1
        limit = self.config.max_errors
        if limit and self._own_errors >= limit and not self.disabled:
            self.disabled = True
            logger.error("fsdp_mem_otel: %d internal errors, tracker disabled itself", self.errors_total)
            try:
                self.detach()
            except Exception:  # noqa: BLE001
                logger.exception("fsdp_mem_otel: detach after errors failed")

    # -- optimizer -----------------------------------------------------------------------------
    def _on_optimizer_pre(self, *_: Any) -> None:
        self.in_optimizer = True

    def _on_optimizer_post(self, *_: Any) -> None:
        self.in_optimizer = False
        self._track_optimizer_state()

    def _track_optimizer_state(self) -> None:
        # Optimizer state tensors are created once and updated in place: only new ones (first
        # step, load_state_dict) need the ledger; the rest is one dict lookup each.
        if self.optimizer is None:
            return
        known = self._opt_tensors
        try:
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        ref = known.get(id(value))
                        if ref is None or ref() is not value:
                            self.ledger.track(value, OPTIMIZER_STATE)
                            known[id(value)] = weakref.ref(value)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _origin(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"


def _check_optimizer_covers_model(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    model_params = {id(p) for p in model.parameters()}
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    if opt_params and not any(id(p) in model_params for p in opt_params):
        raise ValueError(
            "optimizer does not optimize any parameter of model; pass the optimizer built from "
            "model.parameters() after wrapping with FSDP"
        )
