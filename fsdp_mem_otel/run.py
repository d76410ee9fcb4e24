"""Track a training job without touching its code: run the script under the launcher.

    torchrun [torchrun options] -m fsdp_mem_otel.run train.py [script args]
    torchrun [torchrun options] -m fsdp_mem_otel.run -m package.module [args]   (torchtitan: -m torchtitan.train)
    python -m fsdp_mem_otel.run train.py [args]                                   (one process)
    fsdp-mem-otel run train.py [args]                                             (the same)

The script runs unchanged, as ``python train.py`` would run it (``runpy``: ``__name__ ==
"__main__"``, ``sys.argv`` = the script and its arguments, the script's folder first on
``sys.path``; ``-m`` as ``python -m``), after automatic attachment is installed
(``fsdp_mem_otel.integrations.auto``): the tracker attaches to the FSDP root at its first
forward, configured from the environment like ``FSDPMemoryTracker.from_env`` (every
``FSDP_MEM_OTEL_*`` and ``OTEL_*`` variable), finds the optimizers that step the root's
parameters, closes one step per optimizer step, and closes at exit. ``FSDP_MEM_OTEL_ENABLED=0``
runs the script with nothing installed.

It never stops the training, and says what it does, on rank 0, on stderr: one line when the
tracker attaches (the root, the mode, every exporter and where), one at exit (how many step
reports went where); ``FSDP_MEM_OTEL_QUIET=1`` silences both. Each mistake is one line and
switches off only its part: a variable whose value is not accepted (said once, on rank 0:
``config.read_env`` says what each part is), a Prometheus port in use or a JSONL file that cannot
be written (said by the rank that hits it), a JSONL path without ``{rank}`` on several ranks
(each rank gets its own file, ``run.rank0.jsonl``; said on rank 0).

Nothing of torch is imported here: the attachment is installed right after the script (or the
libraries it uses) imports ``torch.distributed.fsdp``, so a script that sets torch's
environment variables before importing torch keeps working as without the launcher.

The same without changing the command (a pod template): ``FSDP_MEM_OTEL_AUTO=1`` and
``PYTHONPATH`` set to the folder ``python -m fsdp_mem_otel.run --pythonpath`` prints, whose
``sitecustomize`` calls ``enable()`` in every Python process started with them (see docs/launcher.md).
"""

from __future__ import annotations

import atexit
import collections
import importlib.abc
import logging
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

USAGE = """usage: python -m fsdp_mem_otel.run SCRIPT.py [ARGS ...]
       python -m fsdp_mem_otel.run -m MODULE [ARGS ...]
       python -m fsdp_mem_otel.run --pythonpath

Runs a training script (or module) unchanged with fsdp_mem_otel's memory tracking attached to its FSDP
model, configured from the FSDP_MEM_OTEL_* / OTEL_* environment. Under torchrun:
    torchrun --nproc-per-node 8 -m fsdp_mem_otel.run train.py --your --args
--pythonpath prints the folder to put on PYTHONPATH (with FSDP_MEM_OTEL_AUTO=1) to get the same without
changing the command."""

#: the module whose import installs the attachment (FSDP1 and FSDP2 both live there)
TRIGGER = "torch.distributed.fsdp"
_enabled_explicit: bool | None = None  # None: not enabled in this process
NO_FSDP = "no_fsdp_model"
#: what this module noted (the attachment's own notes: ``fsdp_mem_otel.integrations.auto.counts()``)
counts: collections.Counter[str] = collections.Counter()


def bootstrap_dir() -> str:
    """The folder whose ``sitecustomize`` enables automatic attachment when ``FSDP_MEM_OTEL_AUTO=1``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def enable(explicit: bool = True) -> bool:
    """Install automatic attachment in this process, now if ``torch.distributed.fsdp`` is imported
    already, else as soon as it is. ``explicit``: launched by this module (else by the environment
    bootstrap). Returns False when tracking is switched off (``FSDP_MEM_OTEL_ENABLED=0``); nothing
    else here stops it: a setting that is not accepted is said (once, on rank 0) when the tracker
    attaches, in a process that wraps a model with FSDP, and switches off only its part. Safe to
    call twice."""
    global _enabled_explicit
    from fsdp_mem_otel import env
    from fsdp_mem_otel.config import read_env

    try:
        settings = read_env()
    except Exception as exc:  # noqa: BLE001 - never stop the job (read_env raises for no value)
        logger.error("fsdp_mem_otel.run: memory tracking is off for this run: the environment could not be read: %r",
                     exc)
        return False
    if not settings.tracker.enabled and not any(b.var == env.FSDP_MEM_OTEL_ENABLED for b in settings.bad):
        return False
    if _enabled_explicit is not None:
        _enabled_explicit = _enabled_explicit or explicit
        if explicit and TRIGGER in sys.modules:
            _install(True)
        return True
    _enabled_explicit = explicit
    atexit.register(_no_fsdp_note)
    if TRIGGER in sys.modules:
        _install(explicit)
    else:
        sys.meta_path.insert(0, _AfterImport(TRIGGER, lambda: _install(bool(_enabled_explicit))))
    return True


def wrapped_modules() -> int:
    """How many modules got FSDP in this process since the attachment was installed."""
    auto = sys.modules.get("fsdp_mem_otel.integrations.auto")
    current = auto.current() if auto is not None else None  # type: ignore[attr-defined]
    return current.wrapped if current is not None else 0


def _no_fsdp_note() -> None:
    if wrapped_modules() == 0:
        counts[NO_FSDP] += 1
        logger.log(logging.WARNING if _enabled_explicit else logging.INFO,
                   "fsdp_mem_otel.run: this process wrapped no model with FSDP: nothing was tracked")


def _install(explicit: bool) -> None:
    try:
        from fsdp_mem_otel.integrations import auto

        auto.install(explicit)
    except Exception:  # noqa: BLE001 - never stop the job
        logger.exception("fsdp_mem_otel.run: automatic attachment could not be installed; the job runs untracked")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback`` once, right after module ``name`` has been executed (a post-import hook):
    the other finders find the module, its loader is wrapped for that one execution."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self._name = name
        self._callback = callback
        self._busy = False

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != self._name or self._busy:
            return None
        self._busy = True
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderThenCall(spec.loader, self._done)
        return spec

    def _done(self, module: Any) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self._callback()


class _LoaderThenCall(importlib.abc.Loader):
    """``loader`` for one module, calling ``then(module)`` after executing it; puts ``loader``
    back on the module and its spec."""

    def __init__(self, loader: Any, then: Callable[[Any], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _keep_package_importable() -> None:
    """This package found through ``sys.path[0]`` (run from a checkout) stays importable once
    ``sys.path[0]`` is the script's folder: its folder goes last on ``sys.path``."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not any(os.path.abspath(p or os.curdir) == here for p in sys.path[1:]):
        sys.path.append(here)


def run_script(path: str, args: Sequence[str]) -> None:
    """Run ``path`` as ``python path args`` would, in this process."""
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    _keep_package_importable()
    runpy.run_path(path, run_name="__main__")


def run_module(name: str, args: Sequence[str]) -> None:
    """Run module ``name`` as ``python -m name args`` would, in this process."""
    sys.argv = [name, *args]  # runpy puts the module's file in argv[0]
    sys.path[0] = os.getcwd()
    _keep_package_importable()
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str] | None = None, prog: str = "python -m fsdp_mem_otel.run") -> int:
    """Run the script (or ``-m`` module) in ``argv`` with automatic attachment; ``prog`` names the
    command in the usage and in the one-line errors (``fsdp-mem-otel run`` from the CLI)."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = USAGE.replace("python -m fsdp_mem_otel.run", prog)
    if not args or args[0] in ("-h", "--help"):
        print(usage, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--pythonpath":
        print(bootstrap_dir())
        return 0
    if args[0] == "-m":
        if len(args) < 2:
            print(f"{prog}: -m needs a module name (as python -m: {prog} -m package.module [args])", file=sys.stderr)
            return 2
        enable(explicit=True)
        run_module(args[1], args[2:])
        return 0
    if args[0].startswith("-"):
        print(f"{prog}: unknown option {args[0]!r}; accepted before the script: -m MODULE, --pythonpath, --help",
              file=sys.stderr)
        return 2
    if not os.path.exists(args[0]):
        print(f"{prog}: no such script: {args[0]!r}; give the training script's path (or -m package.module)",
              file=sys.stderr)
        return 2
    enable(explicit=True)
    run_script(args[0], args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
