"""Light-mode activations: the tensors autograd saves for backward, seen through saved-tensor hooks.

During each outermost FSDP module's forward, ``SavedTensorAccounting`` keeps autograd's default
saved-tensor hooks pushed (``torch.autograd.graph.saved_tensors_hooks``, the mechanism
``save_on_cpu`` and activation checkpointing use). Its pack hook accounts the storage of every
tensor autograd saves as ``activation`` unless the ledger already knows it (parameters, inputs,
gradients keep their own category) and hands autograd a detached alias with the tensor's version;
unpack gives it back after autograd's own version check (which saved-tensor hooks turn off: an
in-place change of a saved tensor raises as it does untracked).
The storage's bytes leave the ledger when it is freed, i.e. when backward releases it. There is
no per-op interception: the hooks run once per saved tensor, on every step.

Composition:
- Hooks pushed by the user before the forward (``save_on_cpu``, custom offloading) would be
  shadowed by ours; instead ours chain to them: their pack runs, the saved tensor and what their
  pack returns are accounted (a CPU copy counts on the CPU; the original drops out when freed),
  and their unpack is kept.
- An FSDP module recomputed inside a checkpointed region (its hooks fire during backward): ours
  chain to checkpointing's recomputation hooks for that recompute, so what it recomputes counts.
- Activation checkpointing pushes its own hooks inside the checkpointed region: those win there,
  and what checkpointing keeps (its inputs) is saved under ours.
- Compiled regions save through AOTAutograd's ``save_for_backward``, which calls the same hooks
  at run time (dynamo defers them while it traces).

The hooks live on the forward thread's stack and are popped when the outermost forward ends,
also when it raises. ``torch.func`` transforms refuse to run while saved-tensor hooks are set:
switch the accounting off (``TrackerConfig(activations=False)``) for models that call them inside
an FSDP module's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fsdp_mem_otel.schema import ACTIVATION
from fsdp_mem_otel.training.light.ledger import INDEX, Ledger

_STRIDED = torch.strided
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]


def _unpack(packed: Any) -> torch.Tensor:
    # Autograd checks a saved tensor's version only when no saved-tensor hooks are set: ours
    # repeat its check, so that an in-place change of a saved tensor still raises as it would
    # untracked instead of giving wrong gradients.
    if packed.__class__ is not tuple:
        return packed  # type: ignore[no-any-return]
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} "
            "instead. (Raised by fsdp_mem_otel's saved-tensor hooks, in place of autograd's own check, "
            "which saved-tensor hooks turn off.) Hint: enable anomaly detection with "
            "torch.autograd.set_detect_anomaly(True) to find the operation.")
    return t  # type: ignore[no-any-return]


def _remove_hooks(pack: Callable[[torch.Tensor], Any]) -> None:
    """Take the hooks whose pack is ``pack`` off this thread's stack, putting back, in order,
    those pushed above them since (none found: the stack as it was). Where pushing is disabled
    (AOTAutograd's runtime, ``torch.func``), only from the top: theirs could not be put back."""
    top = _top_hooks(True)
    if top is None or top[0] is pack or not _hooks_enabled():
        if top is not None and top[0] is pack:
            _pop_hooks()
        return
    above: list[tuple[Any, Any]] = []
    try:
        while (top := _top_hooks(True)) is not None:
            _pop_hooks()
            if top[0] is pack:
                break
            above.append(top)
    finally:
        for their_pack, their_unpack in reversed(above):
            _push_hooks(their_pack, their_unpack)


class SavedTensorAccounting:
    """Pushes accounting saved-tensor hooks for one forward at a time; never raises."""

    def __init__(self, ledger: Ledger, on_error: Callable[[BaseException], None],
                 owners: list[str] | None = None) -> None:
        self._ledger = ledger
        self._cat = INDEX[ACTIVATION]
        self._entries = ledger.entries
        self._on_error = on_error
        #: the FSDP modules whose forward runs, innermost last: a saved tensor is the innermost's
        self._owners = owners if owners is not None else []
        self._pushed: Callable[[torch.Tensor], Any] | None = None  # our pack hook while pushed

    @property
    def active(self) -> bool:
        return self._pushed is not None

    def push(self) -> bool:
        """Start accounting saved tensors on this thread (the outermost forward begins); returns
        whether this call pushed the hooks (False: pushed already, or the push failed), so that
        only the caller that pushed them pops them."""
        if self._pushed is not None:
            return False
        try:
            top = _top_hooks(True)
            if top is None:
                pack, unpack = self._pack, _unpack
            else:
                pack, unpack = self._chain(*top), top[1]
            _push_hooks(pack, unpack)
            self._pushed = pack
            return True
        except Exception as exc:  # noqa: BLE001 - e.g. saved-tensor hooks disabled by the caller
            self._on_error(exc)
            return False

    def pop(self) -> None:
        """Stop accounting (the outermost forward ended or raised); a no-op if not pushed. Where
        hooks were pushed above ours since and are still there (a checkpointed region, the
        user's ``save_on_cpu``, left open when the tracker detaches or a scope ends), ours are
        taken out from under them and theirs stay, in order: left behind, ours would run on
        every later forward of the thread. Hooks live per thread: popped from another thread
        (a detach there), or where theirs could not be put back, ours stay where they are and
        only hand tensors over, accounting nothing."""
        pack, self._pushed = self._pushed, None
        if pack is None:
            return
        try:
            _remove_hooks(pack)
        except Exception as exc:  # noqa: BLE001
            self._on_error(exc)

    def _pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int] | torch.Tensor:
        # Popped, yet still called (left on a stack ``pop`` could not reach: see there): account
        # nothing, but hand over as ever, the version check included.
        if self._pushed is not None:
            try:
                cls = type(t)  # the common cases (an activation, an unsharded weight), written out
                if (cls is _Tensor or cls is _Parameter) and t.layout is _STRIDED:
                    st = t.untyped_storage()
                    if id(st) not in self._entries:
                        owners = self._owners
                        self._ledger.new_entry(st, self._cat, None, owners[-1] if owners else None)
                else:
                    self._ledger.track_new_at(t, self._cat, self._owners[-1] if self._owners else None)
            except Exception as exc:  # noqa: BLE001 - accounting must never break autograd
                self._on_error(exc)
        # A saved output held as itself would tie it to its own grad_fn, a cycle through C++ that
        # keeps it alive when a graph is dropped without backward: hand autograd a detached alias
        # (it shares the version counter). A leaf (a parameter, an input) has no grad_fn to tie:
        # it goes as it is (a detach costs ~1 us and one more tensor object for the collector, for
        # 2 in 5 saved tensors). With the version now, for ``_unpack``'s check.
        saved = t if t.is_leaf else t.detach()
        try:
            return saved, t._version
        except Exception:  # noqa: BLE001 - a tensor without a version counter: no check
            return saved

    def _chain(self, their_pack: Callable[[torch.Tensor], Any], _: Any) -> Callable[[torch.Tensor], Any]:
        ledger, on_error, owners, cat = self._ledger, self._on_error, self._owners, self._cat

        def pack(t: torch.Tensor) -> Any:
            packed = their_pack(t)
            if self._pushed is None:  # popped, yet still called: theirs alone
                return packed
            try:  # what is saved (alive as long as someone holds it) and what they keep of it
                owner = owners[-1] if owners else None
                ledger.track_new_at(t, cat, owner)
                for obj in packed if isinstance(packed, tuple) else (packed,):
                    if isinstance(obj, torch.Tensor):
                        ledger.track_new_at(obj, cat, owner)
            except Exception as exc:  # noqa: BLE001
                on_error(exc)
            return packed

        return pack
