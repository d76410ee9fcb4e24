"""Automatic attachment: what ``fsdp_mem_otel.run`` (and the ``FSDP_MEM_OTEL_AUTO`` bootstrap)
installs so that a training script that never mentions this package is tracked.

How a model is found, measured and closed, without the training code's help:

- **Wrapping** is watched at FSDP's two public entry points (``FSDPWraps``): the ``fully_shard``
  function (FSDP2; the names ``torch.distributed.fsdp.fully_shard`` and its re-exports are
  replaced by a wrapper that calls it and then notes the modules), and the constructor of
  ``FullyShardedDataParallel`` (FSDP1). Nothing else of FSDP is touched here; the tracker's
  adapters do the rest, as for a tracker built in code. Every module that gets FSDP receives two
  forward pre-hooks of its own (not global ones): one before FSDP's pre-forward hook, one after.
- **The root** is the first of those modules whose forward runs: FSDP makes the same choice (its
  lazy initialization makes the first module to run forward the root). There the tracker is built
  from the environment (``FSDPMemoryTracker.from_env``) and attached, before FSDP's own root
  pre-forward; the wrap hooks of every module under the root are removed at once, so blocks that
  ``torch.compile`` compiles at their first call never see them. The tracker's pre-hooks that the
  running call can no longer pick up (``nn.Module`` iterates a copy of its pre-hooks) are run by
  the wrap hooks in their place, so the first call is measured like every other. A second root
  (an RL critic beside its actor) is not tracked: logged once and counted.
- **Optimizers** are found by the parameters they step: global optimizer step hooks (installed
  once a model gets FSDP, never before) match each optimizer's parameters against the root's,
  and the tracker takes each one found (``add_optimizer``: wrappers and containers unwrapped as
  always). A step closes after the outermost optimizer step (a container such as torchtitan's
  ``OptimizersContainer`` steps its inner optimizers inside its own step: one report), once every
  optimizer known to step the root's parameters has stepped since the root's last forward; a
  step left open by an optimizer that did not step closes at the root's next forward. So
  gradient accumulation gives one report per optimizer step, and the step closes before the
  training zeroes the gradients, as ``tracker.step()`` right after ``optimizer.step()`` does.
- **Inputs**: the root's forward arguments are accounted as ``inputs`` at each of its forwards.
- **The end**: at interpreter exit the tracker closes (a last report if the root ran forwards
  since the last one, then its exporters flush); on SIGTERM the exporters flush themselves
  (``exporters/worker.py``), as for every tracker.
- **What it says**, on rank 0, each once, on stderr: when the tracker attaches, what it tracks
  and where every report goes (``fsdp_mem_otel: tracking Net (FSDP2, 3 modules) in light mode;
  Prometheus http://0.0.0.0:9400/metrics (base port, + LOCAL_RANK per rank), JSONL
  /tmp/run.rank{0..1}.jsonl, spans off``), and at exit how many step reports went where
  (``fsdp_mem_otel: 12 step reports on rank 0: Prometheus :9400, JSONL /tmp/run.rank0.jsonl; 0
  tracker errors``); ``FSDP_MEM_OTEL_QUIET=1`` silences both. A setting the environment gets
  wrong, a port in use, a JSONL file that cannot be written: one line each, that part off, the
  rest on (``_session.py``, ``config.read_env``, ``exporters.build_exporters``).

Never harm: every hook here catches what it raises; each unusual case (no FSDP model, a second
root, several optimizers, a root never stepped, a tracker the training attached itself, a tracker
that could not attach, an internal error) is logged once and counted in ``counts()``; training
runs as it would without this module. A root's tracker lives as long as the root: nothing here
holds the model strongly.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_mem_otel.integrations._session import TrackingSession, say

logger = logging.getLogger(__name__)

#: a root that runs this many forwards without an optimizer step closes a step anyway (bounded memory)
MAX_FORWARDS_PER_STEP = 256

# kinds of what is counted (``counts()``), each logged once; a process that wraps no model with FSDP
# is noted by ``fsdp_mem_otel.run`` (this module is imported only once ``torch.distributed.fsdp`` is)
SEVERAL_ROOTS = "several_roots"
SEVERAL_OPTIMIZERS = "several_optimizers"
NEVER_STEPPED = "never_stepped"
FORWARDS_WITHOUT_STEP = "forwards_without_optimizer_step"
OWN_TRACKER = "own_tracker"
ATTACH_FAILED = "attach_failed"
ERROR = "error"


class FSDPWraps:
    """Calls ``on_wrapped(modules)`` whenever a module gets FSDP: after each ``fully_shard`` call
    (FSDP2) and after each ``FullyShardedDataParallel`` construction (FSDP1).

    Replaced: the attribute ``fully_shard`` of ``torch.distributed.fsdp``,
    ``torch.distributed.fsdp._fully_shard`` and the deprecated ``torch.distributed._composable.fsdp``
    modules (those loaded; later ``from ... import fully_shard`` statements get the wrapper), and
    ``FullyShardedDataParallel.__init__``. ``uninstall`` puts back each original that is still
    ours (a later patch on top is left alone). The wrapper keeps the function's attributes
    (``fully_shard.state``), name and ``__wrapped__``.
    """

    _NAMESPACES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                   "torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard")

    def __init__(self, on_wrapped: Callable[[list[nn.Module]], None]) -> None:
        self._on_wrapped = on_wrapped
        self._saved: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, ours)

    def install(self) -> None:
        if self._saved:
            return
        import torch.distributed.fsdp as fsdp
        from torch.distributed.fsdp import FullyShardedDataParallel

        original = fsdp.fully_shard
        on_wrapped = self._on_wrapped

        @functools.wraps(original)
        def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(module, *args, **kwargs)
            on_wrapped(list(module) if isinstance(module, list | tuple) else [module])
            return out

        for name in self._NAMESPACES:
            owner = sys.modules.get(name)
            if owner is not None and getattr(owner, "fully_shard", None) is original:
                self._set(owner, "fully_shard", original, fully_shard)
        init = FullyShardedDataParallel.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            on_wrapped([self])

        self._set(FullyShardedDataParallel, "__init__", init, __init__)

    def _set(self, owner: Any, name: str, original: Any, ours: Any) -> None:
        self._saved.append((owner, name, original, ours))
        setattr(owner, name, ours)

    def uninstall(self) -> None:
        for owner, name, original, ours in reversed(self._saved):
            if getattr(owner, name, None) is ours:
                setattr(owner, name, original)
        self._saved.clear()


def run_pre_hooks(module: nn.Module, hook_ids: Iterable[int], args: Any, kwargs: Any) -> Any:
    """Run ``module``'s forward pre-hooks ``hook_ids`` as ``nn.Module.__call__`` would (their
    results replace the arguments); returns ``(args, kwargs)`` if one changed them, else None."""
    changed = False
    for hook_id in hook_ids:
        hook = module._forward_pre_hooks.get(hook_id)
        if hook is None:
            continue
        if hook_id in module._forward_pre_hooks_with_kwargs:
            out = hook(module, args, kwargs)
            if out is not None:
                args, kwargs = out
                changed = True
        else:
            out = hook(module, args)
            if out is not None:
                args = out if isinstance(out, tuple) else (out,)
                changed = True
    return (args, kwargs) if changed else None


class AutoAttach:
    """The process's automatic attachment (one per process: ``install()``)."""

    def __init__(self, explicit: bool) -> None:
        #: launched through ``fsdp_mem_otel.run`` (else the environment bootstrap)
        self.explicit = explicit
        self.counts: collections.Counter[str] = collections.Counter()
        self._logged: set[str] = set()
        self._wraps = FSDPWraps(self._on_wrapped)
        self._pending: weakref.WeakKeyDictionary[nn.Module, list[RemovableHandle]] = weakref.WeakKeyDictionary()
        # root id -> (its tracker's pre-hooks to run after FSDP's, the tail hook that runs them)
        self._tail: dict[int, tuple[list[int], RemovableHandle]] = {}
        self._root: weakref.ref[_Root] | None = None
        self._optimizer_hooks: list[RemovableHandle] = []
        self._stack: list[int] = []  # ids of the optimizers whose step is running, outermost first
        self._window: list[torch.optim.Optimizer] = []  # optimizers that stepped in this outermost step
        self.wrapped = 0  # modules that got FSDP
        self._exit_registered = False

    # -- lifecycle -------------------------------------------------------------------------------
    def install(self) -> None:
        self._wraps.install()

    def uninstall(self) -> None:
        """Undo everything (tests): wraps, hooks, and the root's tracker closed."""
        self._wraps.uninstall()
        for handles in list(self._pending.values()):
            for h in handles:
                h.remove()
        self._pending = weakref.WeakKeyDictionary()
        for h in self._optimizer_hooks:
            h.remove()
        self._optimizer_hooks.clear()
        root = self.root
        if root is not None:
            root.close()
        atexit.unregister(self._at_exit)

    @property
    def root(self) -> _Root | None:
        return self._root() if self._root is not None else None

    @property
    def tracker(self) -> Any:
        """The tracker of the root being tracked, or None."""
        root = self.root
        return root.session.tracker if root is not None else None

    def note(self, kind: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        """Count one ``kind`` of case and log it, the first time only."""
        self.counts[kind] += 1
        if kind not in self._logged:
            self._logged.add(kind)
            logger.log(level, "fsdp_mem_otel.run: " + message, *args)

    def failed(self, where: str, exc: BaseException) -> None:
        self.counts[ERROR] += 1
        if f"{ERROR}:{where}" not in self._logged:
            self._logged.add(f"{ERROR}:{where}")
            logger.warning("fsdp_mem_otel.run: %s failed (training goes on; logged once): %r", where, exc,
                           exc_info=exc)

    # -- a module gets FSDP ----------------------------------------------------------------------
    def _on_wrapped(self, modules: list[nn.Module]) -> None:
        try:
            self._hook_optimizers()
            for module in modules:
                if not isinstance(module, nn.Module) or module in self._pending:
                    continue
                self.wrapped += 1
                self._pending[module] = [
                    module.register_forward_pre_hook(self._first_forward, prepend=True, with_kwargs=True),
                    module.register_forward_pre_hook(self._first_forward_tail, with_kwargs=True),
                ]
        except Exception as exc:  # noqa: BLE001 - never into training
            self.failed("watching a wrapped module", exc)

    def _hook_optimizers(self) -> None:
        if not self._optimizer_hooks:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._optimizer_hooks = [register_optimizer_step_pre_hook(self._optimizer_pre),
                                     register_optimizer_step_post_hook(self._optimizer_post)]

    def _unhook_subtree(self, module: nn.Module) -> None:
        for m in module.modules():
            for h in self._pending.pop(m, ()):
                h.remove()

    # -- the root's first forward ----------------------------------------------------------------
    def _first_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        try:
            before = set(module._forward_pre_hooks)
            handles = self._pending.get(module)
            tail = handles[1] if handles else None
            if tail is not None and handles:  # the running call still calls the tail hook: it removes itself then
                handles.remove(tail)
            if not self._attach(module):
                if tail is not None:
                    tail.remove()
                return None
            now = [h for h in module._forward_pre_hooks if tail is None or h != tail.id]
            old = [i for i, hook_id in enumerate(now) if hook_id in before]
            if not old:  # no hook of the running call survives: run all of them now
                front, back = now, []
            else:
                front = [h for h in now[:old[0]] if h not in before]
                back = [h for h in now[old[0]:] if h not in before]
            if tail is not None:
                self._tail[id(module)] = (back, tail)
            return run_pre_hooks(module, front, args, kwargs)
        except Exception as exc:  # noqa: BLE001
            self.failed("attaching at the first forward", exc)
            return None

    def _first_forward_tail(self, module: nn.Module, args: Any, kwargs: Any = None) -> Any:
        # ``kwargs`` may be missing: removing a hook's handle also forgets that it takes them, and the
        # running call still holds the hooks it started with
        replay = self._tail.pop(id(module), None)
        if replay is None:
            return None
        back, handle = replay
        handle.remove()
        try:
            return run_pre_hooks(module, back, args, kwargs) if back else None
        except Exception as exc:  # noqa: BLE001
            self.failed("the first forward's hooks", exc)
            return None

    def _attach(self, module: nn.Module) -> bool:
        """Track ``module`` (the first FSDP module to run forward: the root) if it should be."""
        self._unhook_subtree(module)
        root = self.root
        if root is not None and root.holds(module):  # wrapped after the root attached, under it
            return False
        if root is not None:
            self.note(SEVERAL_ROOTS, "a second FSDP root (%s) ran its first forward; only the first one (%s) is "
                      "tracked", model_name(module), root.name)
            return False
        from fsdp_mem_otel.training.tracker import attached_trackers

        own = [t for t in attached_trackers() if _overlap(t.model, module)]
        if own:
            self.note(OWN_TRACKER, "the training attached its own tracker to the FSDP root (%s): left to it",
                      model_name(module))
            return False
        root = _Root(self, module)
        if root.session.switched_off:  # FSDP_MEM_OTEL_ENABLED not accepted: said when it was read
            root.session.close()
            return False
        if not root.session.active:
            root.session.close()  # the exporters it may have opened
            self.note(ATTACH_FAILED, "the tracker could not attach to the FSDP root (%s): %s; training goes on "
                      "untracked", model_name(module), root.session.failed or "see the log above")
            return False
        self._root = weakref.ref(root)
        root.say(lambda: root.session.announcement(root.name))
        if not self._exit_registered:  # after the exporters' own exit handler: runs before it
            self._exit_registered = True
            atexit.register(self._at_exit)
        return True

    # -- optimizer steps -------------------------------------------------------------------------
    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        try:
            stack = self._stack
            if id(optimizer) in stack:  # its previous step raised before its end
                del stack[stack.index(id(optimizer)):]
                self._window.clear()
            stack.append(id(optimizer))
            root = self.root
            if root is not None:
                root.found(optimizer)
        except Exception as exc:  # noqa: BLE001
            self.failed("an optimizer step pre-hook", exc)

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        try:
            stack = self._stack
            self._window.append(optimizer)
            if id(optimizer) in stack:
                del stack[stack.index(id(optimizer)):]
            if stack:
                return
            window, self._window = self._window, []
            root = self.root
            if root is not None:
                root.stepped(window)
        except Exception as exc:  # noqa: BLE001
            self.failed("an optimizer step post-hook", exc)

    # -- the end ---------------------------------------------------------------------------------
    def _at_exit(self) -> None:
        root = self.root
        if root is not None:
            root.close()


class _Root:
    """The tracked root: its tracker (a ``TrackingSession`` from the environment), the optimizers
    found stepping its parameters, and when a step closes."""

    def __init__(self, auto: AutoAttach, model: nn.Module) -> None:
        self.auto = auto  # the process singleton; the root model is held by the tracker alone
        self.name = model_name(model)
        self.session = TrackingSession(None, None, None)
        self._params = {id(p) for p in model.parameters()}
        self._matches: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        self._outermost: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._stepped: set[int] = set()  # ids of tracked optimizers stepped since the root's last forward
        self._closed_since_forward = False
        self._forwards = 0  # root forwards since the last report
        self.optimizer_steps = 0
        self.closed = False
        self._hook: RemovableHandle | None = None
        self.session.start(model, None, watch_inputs=False)
        if self.session.active:
            self._hook = model.register_forward_pre_hook(self._on_forward, prepend=True, with_kwargs=True)

    def _on_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        try:
            if self._stepped and not self._closed_since_forward:  # an optimizer of the root did not step
                self._close()
            elif self._forwards >= MAX_FORWARDS_PER_STEP:
                self.auto.note(FORWARDS_WITHOUT_STEP, "the FSDP root ran %d forwards without an optimizer step over "
                               "its parameters: a report is closed every %d forwards", MAX_FORWARDS_PER_STEP,
                               MAX_FORWARDS_PER_STEP)
                self._close()
            self._stepped.clear()
            self._closed_since_forward = False
            self._forwards += 1
            self.session.track_inputs((args, kwargs))
        except Exception as exc:  # noqa: BLE001
            self.auto.failed("the root's forward pre-hook", exc)

    def _steps_root(self, optimizer: torch.optim.Optimizer) -> bool:
        known = self._matches.get(optimizer)
        if known is None:
            params = self._params
            known = self._matches[optimizer] = any(
                id(p) in params for group in optimizer.param_groups for p in group["params"])
        return known

    def found(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer starts its step: track it if it steps the root's parameters."""
        if self.closed or not self._steps_root(optimizer):
            return
        tracker = self.session.tracker
        if any(optimizer is o for o in tracker.optimizers):
            return
        tracker.add_optimizer(optimizer)

    def stepped(self, window: list[torch.optim.Optimizer]) -> None:
        """An outermost optimizer step ended (``window``: the optimizers that stepped in it)."""
        if self.closed:
            return
        ours = [o for o in window if self._steps_root(o)]
        if not ours:
            return
        for optimizer in reversed(ours):  # outermost first; its pre-hook may have run before the root existed
            self.found(optimizer)
        self.optimizer_steps += 1
        known_outermost = len(self._outermost)
        self._outermost.add(ours[-1])
        if len(self._outermost) > max(known_outermost, 1):
            names = ", ".join(sorted(type(o).__name__ for o in self._outermost))
            self.auto.note(SEVERAL_OPTIMIZERS, "several optimizers step the FSDP root's parameters (%s): a report "
                           "closes once all of them stepped", names)
        tracker = self.session.tracker
        inner = {id(o) for o in tracker.optimizers}
        for optimizer in ours:
            if id(optimizer) in inner:
                self._stepped.add(id(optimizer))
            else:  # a container: the optimizers it holds stepped inside it
                self._stepped.update(id(o) for o in getattr(optimizer, "optimizers", ()) if id(o) in inner)
        if inner <= self._stepped and not self._closed_since_forward:
            self._close()

    def _close(self) -> None:
        from fsdp_mem_otel.training.tracker import attached_trackers

        tracker = self.session.tracker
        if any(t is not tracker and _overlap(t.model, tracker.model) for t in attached_trackers()):
            self.auto.note(OWN_TRACKER, "the training attached its own tracker to the FSDP root (%s): left to it",
                           self.name)
            self.close(final=False)
            return
        self._closed_since_forward = True
        self._forwards = 0
        self.session.step()

    def close(self, final: bool = True) -> None:
        """Close the tracker (a last report if the root ran forwards since the previous one)."""
        if self.closed:
            return
        try:
            if final and self._forwards:
                self.session.step()
            if final and self.optimizer_steps == 0:
                self.auto.note(NEVER_STEPPED, "no optimizer stepped the FSDP root's parameters (%s) in this run",
                               self.name)
        except Exception as exc:  # noqa: BLE001
            self.auto.failed("the last report", exc)
        self.closed = True
        if self._hook is not None:
            self._hook.remove()
        self.session.close()
        if final:
            self.say(self.session.summary)

    def say(self, line: Callable[[], str]) -> None:
        """Print ``line()`` where the session speaks (rank 0, not quiet); never raises."""
        try:
            if self.session.speaks:
                say(line())
        except Exception as exc:  # noqa: BLE001
            self.auto.failed("saying what is tracked", exc)

    def holds(self, module: nn.Module) -> bool:
        tracker = self.session.tracker
        return tracker is not None and not self.closed and _overlap(tracker.model, module)


def model_name(module: nn.Module) -> str:
    """The class the training defined for ``module``: FSDP2 swaps a module's class for a subclass
    ``FSDP<Class>`` (the class it defined comes after ``FSDPModule`` in its bases), FSDP1 wraps
    the module (``.module``)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    cls = type(module)
    if isinstance(module, FullyShardedDataParallel):
        return type(module.module).__name__
    if isinstance(module, FSDPModule):
        own = [b for b in cls.__bases__ if not issubclass(b, FSDPModule)]
        if own:
            return own[0].__name__
    return cls.__name__


def _overlap(a: nn.Module, b: nn.Module) -> bool:
    """Whether one of the two models holds the other (or they are one)."""
    return a is b or any(m is b for m in a.modules()) or any(m is a for m in b.modules())


_AUTO: AutoAttach | None = None


def install(explicit: bool = True) -> AutoAttach:
    """Install automatic attachment in this process (once; ``explicit``: launched by
    ``fsdp_mem_otel.run``, which logs a job without FSDP as a warning). Returns the process's
    ``AutoAttach``."""
    global _AUTO
    if _AUTO is None:
        auto = AutoAttach(explicit)
        auto.install()
        _AUTO = auto
    elif explicit:
        _AUTO.explicit = True
    return _AUTO


def uninstall() -> None:
    """Remove automatic attachment from this process and close its tracker (for tests)."""
    global _AUTO
    if _AUTO is not None:
        _AUTO.uninstall()
        _AUTO = None


def current() -> AutoAttach | None:
    """The process's ``AutoAttach`` once installed, else None."""
    return _AUTO


def counts() -> dict[str, int]:
    """What was noted so far (kind -> times), e.g. ``{"several_roots": 1}``."""
    return dict(_AUTO.counts) if _AUTO is not None else {}
