"""The hot path: what the adapters call from FSDP's hooks (``Sink``, their ``EventSink``), turned into ledger
updates and snapshots. Every call is contained (failures go to ``on_error``) and O(1): a state event snapshots the
counters and opens or closes a peak window (light mode queues it); saved-tensor hooks are pushed while the
outermost FSDP forward or a recompute runs. Buffer calls: the base, ``sink_bytes.LedgerCalls``."""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.schema import (
    ACTIVATION,
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    BACKWARD_STATES,
    BEFORE_POST_FORWARD,
    BEFORE_PRE_FORWARD,
)
from fsdp_mem_otel.training.adapters.base import tensors_in
from fsdp_mem_otel.training.deep import release_backend_buffers
from fsdp_mem_otel.training.light import log
from fsdp_mem_otel.training.light.activations import SavedTensorAccounting
from fsdp_mem_otel.training.light.ledger import INDEX, Ledger
from fsdp_mem_otel.training.light.recorder import StepRecorder
from fsdp_mem_otel.training.light.sink_bytes import LedgerCalls

_in_backward = torch._C._current_graph_task_id
_ACTIVATION = INDEX[ACTIVATION]
_time_ns = time.time_ns  # bound once: ~140 calls a step
#: time one state event in this many, counted for each: a prime (calls come in fours and eights); not random
_TIMED_EVERY = 13
_POST_FORWARD = frozenset({BEFORE_POST_FORWARD, AFTER_POST_FORWARD})
#: a deferring ledger flushes once this many changes and events wait (a loop without step())
_FLUSH_AT = 1 << 16


def _nothing(*_: Any) -> None:
    return None


class Sink(LedgerCalls):
    """Adapter events in, ledger updates and snapshots out; never raises. ``sample``: the probe's, per window."""

    def __init__(self, ledger: Ledger, recorder: StepRecorder, on_error: Callable[[BaseException], None],
                 sample: Callable[[], None] | None = None, config: TrackerConfig | None = None) -> None:
        self.ledger = ledger
        self.recorder = recorder
        self.report_error = on_error
        self._sample = sample
        self._activations_on = config is None or config.activations
        self.active = False
        #: a deep step's dispatch mode runs: it accounts every op, saved tensors included
        self.deep = False
        #: called as the step's outermost FSDP forward begins, while ``forward_pending`` (deep steps start there)
        self.on_forward: Callable[[], None] = _nothing
        self.forward_pending = False
        #: called with the exception when a forward raised (post-forward hooks without outputs)
        self.on_raising_forward: Callable[[BaseException], None] = _nothing
        #: the FSDP modules whose forward runs now, innermost last: owners of what is saved (leak reports)
        self.modules: list[str] = []
        self.activations = SavedTensorAccounting(ledger, on_error, self.modules)
        self._recompute_activations = SavedTensorAccounting(ledger, on_error, self.modules)
        #: ``tracker.saved_activations()``'s
        self.scoped_activations = SavedTensorAccounting(ledger, on_error, self.modules)
        self._pushing = False  # the outermost forward began: its after_pre_forward pushes the hooks
        self._forward_depth = 0  # nesting of FSDP forwards now running (outside backward)
        self._forward_pushed = False  # the outermost forward pushed the saved-tensor hooks
        self._recompute_depth = 0  # nesting of FSDP forwards recomputed in backward
        self._on_state_ns = 0  # the state events' time this step, as sampled (``_TIMED_EVERY``)
        self._untimed = 0  # state events until the next one timed
        self._record_state = recorder.on_state
        #: (module key, output tensor) walked at before_post_forward, until its after_post_forward
        self._outputs: tuple[str, weakref.ref[torch.Tensor]] | None = None
        ledger.on_flush_error = on_error  # a deferred event that fails counts like one at once

    def end_step(self) -> None:
        """Between steps: pop hooks a raising forward left pushed, reset depths, flush the ledger."""
        try:
            self.ledger.flush()
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        self.activations.pop()
        self._recompute_activations.pop()
        self._forward_depth = self._recompute_depth = 0
        self._forward_pushed = self._pushing = False
        self._outputs = None
        self.modules.clear()
        self._on_state_ns = 0
        self.ledger.flush_seconds = 0.0

    # -- states and windows ---------------------------------------------------------------------
    def on_state(self, key: str, state: str, tensors: object = None, windowed: bool = True) -> None:
        """Module ``key`` reached ``state``; light mode counts ``tensors`` (inputs, outputs) as activations."""
        if state in BACKWARD_STATES:
            self.backward_state(key, state, windowed)
            return
        if not self.active:
            return
        # One clock read, the event's time: in place a clock read costs several loops' worth; timing is sampled.
        t = _time_ns()
        try:
            in_backward = _in_backward() != -1
            if in_backward:  # a forward state in backward: an activation-checkpoint recompute
                self._recompute_state(key, state, tensors)
            elif state == BEFORE_PRE_FORWARD:
                if self._forward_depth:  # an inner module's: ``_forward_begins`` written out
                    self._forward_depth += 1
                else:
                    self._forward_begins()
                self.modules.append(key)
            elif tensors is not None:
                if self._pushing:  # the outermost module's after_pre_forward
                    self._pushing = False
                    self._forward_pushed = self.activations.push()
                if not self.deep and self._activations_on:
                    self._track_io(key, state, tensors)
            elif state in _POST_FORWARD:
                self._note_raising_forward()
            pending = self.ledger.pending
            if pending is None:
                self.recorder.on_state(key, state, in_backward, windowed, t)
            else:  # applied when read, with this time
                log.event(pending, self._record_state, key, state, in_backward, windowed, t)
            if state == AFTER_POST_FORWARD:  # a module's forward ends (or its recompute)
                if self._sample is not None:
                    self._sample()
                if not in_backward:
                    self._outputs = None  # also after a forward that raised (no outputs to walk)
                    if self.modules and self.modules[-1] == key:
                        self.modules.pop()
                    if self._forward_depth > 1:  # an inner module's: ``_forward_ends`` written out
                        self._forward_depth -= 1
                    else:
                        self._forward_ends()
                if pending is not None and len(pending) > _FLUSH_AT:
                    self.ledger.flush()
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        untimed = self._untimed
        if untimed:
            self._untimed = untimed - 1
        else:
            self._untimed = _TIMED_EVERY - 1
            self._on_state_ns += (_time_ns() - t) * _TIMED_EVERY

    def backward_state(self, key: str, state: str, windowed: bool = True) -> None:
        """``on_state`` for ``BACKWARD_STATES``, with less to decide (~70 calls a step)."""
        if not self.active:
            return
        t = _time_ns()
        try:
            if self.deep and state == AFTER_POST_BACKWARD:  # before the window closes
                release_backend_buffers(self.ledger, self.recorder.context)
            pending = self.ledger.pending
            if pending is None:
                self.recorder.on_state(key, state, True, windowed, t)
            else:  # as in ``on_state``
                log.event(pending, self._record_state, key, state, True, windowed, t)
            if state == AFTER_POST_BACKWARD:  # a module's backward ends
                if self._sample is not None:
                    self._sample()
                if pending is not None and len(pending) > _FLUSH_AT:
                    self.ledger.flush()
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)
        untimed = self._untimed
        if untimed:
            self._untimed = untimed - 1
        else:
            self._untimed = _TIMED_EVERY - 1
            self._on_state_ns += (_time_ns() - t) * _TIMED_EVERY

    def _track_io(self, key: str, state: str, tensors: object) -> None:
        # An output walked at before_post_forward comes back as itself unless FSDP cast it: walked once
        # (containers: again, a hook may refill one). Weakly held: a replaced output dies with FSDP's.
        seen, self._outputs = self._outputs, None
        if state == AFTER_POST_FORWARD and seen is not None and seen[0] == key and seen[1]() is tensors:
            return
        track_new = self.ledger.track_new_at
        for t in tensors_in(tensors):
            track_new(t, _ACTIVATION, key)
        if state == BEFORE_POST_FORWARD and type(tensors) is torch.Tensor:
            self._outputs = (key, weakref.ref(tensors))  # walked: a failing walk is retried

    @property
    def overhead(self) -> float:
        """Seconds this step in ``on_state`` (sampled) and flushing; the other hooks are not timed."""
        return self._on_state_ns / 1e9 + self.ledger.flush_seconds

    def open_window(self, key: str, peak_state: str) -> None:
        """Start module ``key``'s peak window (for states reported ``windowed=False``)."""
        if self.active:
            try:
                self._record(self.recorder.open_window, key, peak_state)
            except Exception as exc:  # noqa: BLE001
                self.report_error(exc)

    def close_window(self, key: str, peak_state: str) -> None:
        """End module ``key``'s peak window."""
        if self.active:
            try:
                self._record(self.recorder.close_window, key, peak_state)
            except Exception as exc:  # noqa: BLE001
                self.report_error(exc)

    def end_window(self, key: str, peak_state: str, oldest: bool = False) -> None:
        """End module ``key``'s latest (``oldest``: earliest) peak window alone, where windows overlap."""
        if self.active:
            try:
                self._record(self.recorder.end_window, key, peak_state, oldest)
            except Exception as exc:  # noqa: BLE001
                self.report_error(exc)

    def _record(self, event: Callable[..., None], *args: Any) -> None:
        # a recorder event, with its time: now, or at the flush where the ledger defers
        self.ledger.queue(event, *args, time.time_ns())

    def _note_raising_forward(self) -> None:
        # always_call post-forward hooks with no outputs while an exception propagates: the forward raised
        exc = sys.exc_info()[1]
        if exc is not None:
            self.on_raising_forward(exc)

    def _recompute_state(self, key: str, state: str, tensors: object) -> None:
        # Recompute in a checkpointed region: our hooks chain to checkpointing's, and outputs count as in forward.
        if self.deep or not self._activations_on:
            return
        if state == BEFORE_PRE_FORWARD:
            self.modules.append(key)
            self._recompute_depth += 1
            if self._recompute_depth == 1:
                self._recompute_activations.push()
        elif state == AFTER_POST_FORWARD and self._recompute_depth > 0:  # always called, also when
            self._recompute_depth -= 1  # checkpointing stops the recompute early by raising
            if self.modules and self.modules[-1] == key:
                self.modules.pop()
            if tensors is not None:
                for t in tensors_in(tensors):
                    self.ledger.track_new_at(t, _ACTIVATION, key)
            if self._recompute_depth == 0:
                self._recompute_activations.pop()

    def _forward_begins(self) -> None:
        self._forward_depth += 1
        if self._forward_depth == 1:
            if self.forward_pending:
                self.forward_pending = False
                self.on_forward()
            # the outermost module's after_pre_forward pushes the saved-tensor hooks
            self._pushing = not self.deep and self._activations_on

    def _forward_ends(self) -> None:
        if self._forward_depth > 0:
            self._forward_depth -= 1
        if self._forward_depth == 0 and self._forward_pushed:
            self._forward_pushed = False
            self.activations.pop()

