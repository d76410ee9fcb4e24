"""The hot path: what the adapters call from FSDP's hooks, turned into ledger updates and snapshots.

``Sink`` is the ``EventSink`` the adapters see. Every call is contained (a failure goes to
``on_error`` and never reaches FSDP) and does O(1) work: a state event takes one snapshot of the
ledger's counters and opens or closes a peak window (``StepRecorder``; in light mode the event
and the counter changes are only queued, and applied in order when the counters are read:
``counters.Counters.defer``); light mode's saved tensors are accounted by autograd's
saved-tensor hooks (``SavedTensorAccounting``), pushed while the outermost FSDP forward runs (from
its after_pre_forward) and, for an FSDP module recomputed inside a checkpointed region, while it is
recomputed: on every step, so that every figure a light step reports is measured on it. FSDP
buffers enter the ledger as tensors (``track*``) or, where FSDP's own events tell their size and
lifetime, as integers (``add``):
those calls are its base's, ``sink_bytes.LedgerCalls``. It knows nothing of FSDP and holds no
tensor: unit tests drive it directly (tests/training/test_sink.py).
"""

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
from fsdp_mem_otel.training.light.activations import SavedTensorAccounting
from fsdp_mem_otel.training.light.ledger import INDEX, Ledger
from fsdp_mem_otel.training.light.recorder import StepRecorder
from fsdp_mem_otel.training.light.sink_bytes import LedgerCalls

_in_backward = torch._C._current_graph_task_id
_ACTIVATION = INDEX[ACTIVATION]
_time_ns = time.time_ns  # bound once: ~140 calls a step
#: the state events time one call in this many and count it for each (a prime: a step's calls
#: come in fours and eights per module, so the timed ones are of every kind and move from step to
#: step); a counter, not a random draw, so that the same run makes the same calls
_TIMED_EVERY = 13
_POST_FORWARD = frozenset({BEFORE_POST_FORWARD, AFTER_POST_FORWARD})
#: a deferring ledger flushes once this many changes and events wait (a loop without step())
_FLUSH_AT = 1 << 16


def _nothing(*_: Any) -> None:
    return None


class Sink(LedgerCalls):
    """Adapter events in, ledger updates and snapshots out; never raises.

    Args:
        ledger, recorder: where bytes and snapshots go.
        on_error: called with each internal failure (the tracker counts and logs it).
        sample: called at window ends to sample the device allocator (the tracker's probe), or
            None where there is nothing to sample (no CUDA: the call alone cost ~1.6 us in place).
        config: light mode's switches (``TrackerConfig``): ``activations``, account saved tensors.
    """

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
        #: called when the step's outermost FSDP forward begins, while ``forward_pending`` (the
        #: tracker starts a deep step's dispatch mode there)
        self.on_forward: Callable[[], None] = _nothing
        self.forward_pending = False
        #: called with the exception when a forward raised (post-forward hooks without outputs)
        self.on_raising_forward: Callable[[BaseException], None] = _nothing
        #: the FSDP modules whose forward runs now, innermost last: what they save, receive and
        #: return is theirs (leak reports name them)
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
        """Between steps: pop saved-tensor hooks a forward that raised left pushed, reset depths,
        flush what the ledger deferred."""
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
        """Module ``key`` reached ``state``: take a snapshot, open or close its peak window.

        ``tensors`` (the module's inputs at after_pre_forward, its outputs at after_post_forward)
        are accounted as activations first, in light mode: autograd does not save a module's
        outputs, yet they are alive (the next module's input, the logits, the loss).
        """
        if state in BACKWARD_STATES:
            self.backward_state(key, state, windowed)
            return
        if not self.active:
            return
        # One clock read, the event's time: in place, each clock read or call into torch costs
        # several times what it does in a loop (benchmarks/README.md), so the time this call took
        # is read on a sample of the calls (``_TIMED_EVERY``)
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
            else:  # ``Counters.queue`` written out (the hot path): applied when read, with this time
                pending.extend((self._record_state, 5, key, state, in_backward, windowed, t))
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
        """``on_state`` for a state of FSDP's backward hooks (``BACKWARD_STATES``), with less to
        decide: ~70 calls a step."""
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
                pending.extend((self._record_state, 5, key, state, True, windowed, t))
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
        # A module's inputs or outputs, as activations. An output tensor that before_post_forward
        # walked comes back to after_post_forward as itself unless FSDP's post-forward replaced it
        # (a cast to the output dtype): walked once. (Containers are walked again: a hook may have
        # refilled one.) Known by a weak reference: a replaced output dies when FSDP drops it.
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
        """Seconds this step in ``on_state`` (timed on one call in ``_TIMED_EVERY``, counted for
        each) and in flushing the ledger's queued work (light mode: what on_state did in place
        before); the other hooks are not timed (a timer at each of ~600 calls a step would cost
        more than it tells)."""
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
        # Post-forward hooks with no outputs while an exception propagates: the forward raised
        # (they are always_call hooks). Locate it now, before the windows close.
        exc = sys.exc_info()[1]
        if exc is not None:
            self.on_raising_forward(exc)

    def _recompute_state(self, key: str, state: str, tensors: object) -> None:
        # An FSDP module recomputed inside a checkpointed region: checkpointing's own saved-tensor
        # hooks keep what it recomputes; ours chain to them to account it (light mode), and the
        # module's recomputed outputs count as they do in forward.
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

