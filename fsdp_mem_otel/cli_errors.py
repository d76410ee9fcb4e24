"""How ``fsdp-mem-otel`` commands report a mistake: one line on stderr, no traceback. Standard library only.

A command raises ``UsageError`` for what the user can fix (a file that is not a step-report
file, an output folder it cannot write, a ``--model`` it cannot load); ``run_command`` prints it
as ``fsdp-mem-otel COMMAND: MESSAGE`` and exits 2. Any other exception becomes one line too,
``fsdp-mem-otel COMMAND: TYPE: MESSAGE (run again with --debug for the traceback)``, exit 1.
``--debug`` anywhere among a command's arguments (or ``FSDP_MEM_OTEL_DEBUG=1``, how a launcher
passes it to the ranks it starts) prints the traceback as well. The check of output paths
(``check_writable``) lives here so every command refuses an unwritable one before its work.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

DEBUG_FLAG = "--debug"
#: set by ``--debug``; a launcher exports it to the processes it starts
DEBUG_ENV = "FSDP_MEM_OTEL_DEBUG"
HINT = f"(run again with {DEBUG_FLAG} for the traceback)"


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status ``code`` (default 2)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, its errors in one line (``PROG: MESSAGE; `PROG --help` lists the
    options``, exit 2) instead of the whole usage and the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; `{self.prog} --help` lists the options\n")


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def strip_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (anywhere, before a ``--`` that ends the options), and whether it was there."""
    args = list(argv)
    end = args.index("--") if "--" in args else len(args)
    found = DEBUG_FLAG in args[:end]
    return [a for i, a in enumerate(args) if not (i < end and a == DEBUG_FLAG)], found


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (``TYPE: message`` for anything but a UsageError)."""
    text = " ".join(str(exc).split()) or repr(exc)
    return text if isinstance(exc, UsageError) else f"{type(exc).__name__}: {text} {HINT}"


def run_command(prog: str, fn: Callable[[list[str]], int], argv: Sequence[str], *, debug: bool = False,
                strip: bool = True, catch_all: bool = True) -> int:
    """``fn(argv)`` with ``--debug`` taken out (unless ``strip`` is False: ``debug`` says it); a
    UsageError or any other exception printed as one line on stderr (``prog: ...``) instead of a
    traceback; returns the exit status. ``catch_all`` False: only a UsageError is caught (``run``:
    the user's script's own exceptions keep their traceback, as under ``python``)."""
    args, found = strip_debug(argv) if strip else (list(argv), False)
    before = os.environ.get(DEBUG_ENV)
    debug = debug or found or debug_enabled()
    if debug:
        os.environ[DEBUG_ENV] = "1"  # for the processes the command starts
    try:
        return _run(prog, fn, args, debug, catch_all)
    finally:
        if before is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = before


def _run(prog: str, fn: Callable[[list[str]], int], args: list[str], debug: bool, catch_all: bool) -> int:
    try:
        return fn(args)
    except UsageError as exc:
        if debug:
            traceback.print_exc()
        _say(f"{prog}: {one_line(exc)}")
        return exc.code
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        _say(f"{prog}: interrupted")
        return 130
    except BrokenPipeError:  # the reader of stdout went away (| head): nothing more to say
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - interpreter exit flushes stdout; let it go nowhere
        except OSError:
            pass
        return 141
    except Exception as exc:  # noqa: BLE001 - the command line's last resort: one line, not a traceback
        if not catch_all:
            raise
        if debug:
            traceback.print_exc()
            _say(f"{prog}: {type(exc).__name__}: {' '.join(str(exc).split())}")
        else:
            _say(f"{prog}: {one_line(exc)}")
        return 1


def _say(line: str) -> None:
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def check_writable(path: str | os.PathLike[str], argument: str, *, directory: bool = False) -> None:
    """UsageError naming ``argument`` unless ``path`` can be written: a file (``directory``
    False) whose folder exists and takes a new file, or whose nearest existing ancestor is a
    folder that does (missing folders are created later); with ``directory``, a folder (or one
    that can be created). Tried by creating and removing a temporary file, so it holds for root too."""
    p = os.path.abspath(os.fspath(path))
    if directory:
        if os.path.exists(p) and not os.path.isdir(p):
            raise UsageError(f"{argument} {path}: is a file, not a folder; give a folder to write into")
        probe = p
    else:
        if os.path.isdir(p):
            raise UsageError(f"{argument} {path}: is a folder; give a file name in it")
        probe = os.path.dirname(p)
    existing = probe
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise UsageError(f"{argument} {path}: cannot create {probe}: {existing} is a file, not a folder; "
                         "give a path in a folder you can write to")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".fsdp-mem-otel-probe-", dir=existing)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"{argument} {path}: cannot write in {existing} ({reason}); "
                         "give a path in a folder you can write to") from None
    os.close(fd)
    os.remove(tmp)


def write_failed(path: str | os.PathLike[str], argument: str, exc: OSError) -> UsageError:
    """The UsageError for a write of ``path`` that failed after the checks passed."""
    reason = exc.strerror or str(exc)
    return UsageError(f"{argument} {path}: writing failed ({reason}); give a path in a folder you can write to",
                      code=1)
