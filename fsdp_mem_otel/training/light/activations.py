"""Light-mode activations: the tensors autograd saves for backward, seen through saved-tensor hooks. During each
outermost FSDP forward, ``SavedTensorAccounting`` keeps default saved-tensor hooks pushed: pack accounts each saved
tensor's storage as ``activation`` unless the ledger knows it and hands over a detached alias with its version;
unpack repeats the version check the hooks turn off. Hooks pushed before (``save_on_cpu``) are chained to, as are
checkpointing's for an FSDP module it recomputes; inside its region checkpointing's win. ``torch.func`` transforms
refuse to run while saved-tensor hooks are set: switch the accounting off (``TrackerConfig(activations=False)``)
for models that call them inside an FSDP module's forward."""

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
    # Autograd skips its version check under saved-tensor hooks: repeat it, so an in-place change still raises.
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
    """Take the hooks with ``pack`` off this thread's stack, pushing those above back (none where disabled)."""
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
        """Start accounting on this thread; whether this call pushed the hooks (only the pusher pops them)."""
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
        """Stop accounting (a no-op if not pushed), taking ours out from under hooks pushed since, which stay; from
        another thread, or where theirs could not be put back, ours stay and account nothing."""
        pack, self._pushed = self._pushed, None
        if pack is None:
            return
        try:
            _remove_hooks(pack)
        except Exception as exc:  # noqa: BLE001
            self._on_error(exc)

    def _pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int] | torch.Tensor:
        # Popped, yet still called (a stack ``pop`` could not reach): account nothing, hand over as ever.
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
        # A saved output held as itself ties to its grad_fn (a C++ cycle outliving a dropped graph): hand over a
        # detached alias. A leaf has no grad_fn: as it is (a detach costs ~1 us).
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
