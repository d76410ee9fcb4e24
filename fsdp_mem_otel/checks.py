"""Argument checks shared by every configuration. Standard library only.

One rule everywhere: a value of the wrong type is a ``TypeError``, a value of the right type out
of range a ``ValueError``; each message names the argument and what it accepts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable


def check_int(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an int in ``minimum``..``maximum`` (bools are not ints here)."""
    accepted = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {accepted}; got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {accepted}; got {value!r}")
    return value


def check_optional_int(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int | None:
    return None if value is None else check_int(name, value, minimum, maximum)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__} {value!r}")
    return value


def check_seconds(name: str, value: object, optional: bool = False, zero: bool = False) -> float | None:
    """A number of seconds > 0 (>= 0 with ``zero``; or None when ``optional``)."""
    if value is None and optional:
        return None
    accepted = f"a number of seconds {'>=' if zero else '>'} 0{' or None' if optional else ''}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {accepted}; got {type(value).__name__} {value!r}")
    if not (value >= 0 if zero else value > 0):
        raise ValueError(f"{name} must be {accepted}; got {value!r}")
    return float(value)


def check_text(name: str, value: object, optional: bool = False) -> str | None:
    """A non-empty string (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a non-empty string{' or None' if optional else ''}; "
                        f"got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty string{' or None' if optional else ''}; got {value!r}")
    return value


def check_tls(certfile: object, keyfile: object, client_cafile: object, prefix: str = "",
              must_exist: bool = True) -> None:
    """TLS settings come as certificate + key, optionally a client CA, the files existing
    (unless ``must_exist`` is False: the server then counts a missing file when it starts).
    ``prefix`` is how the caller names them (``tls_`` for ``tls_certfile`` and friends)."""
    cert, key, ca = f"{prefix}certfile", f"{prefix}keyfile", f"{prefix}client_cafile"
    if (certfile is None) != (keyfile is None):
        raise ValueError(f"{cert} and {key} go together: set both for TLS, or neither")
    if client_cafile is not None and certfile is None:
        raise ValueError(f"{ca} (mutual TLS) needs {cert} and {key}")
    for name, path in ((cert, certfile), (key, keyfile), (ca, client_cafile)):
        if path is not None:
            if not isinstance(path, str | os.PathLike):
                raise TypeError(f"{name} must be a file path or None; got {type(path).__name__}")
            if must_exist and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {os.fspath(path)!r}")


def int_at_least(minimum: int, maximum: int | None = None, what: str | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number in ``minimum``..``maximum``, with an error naming
    what is accepted (``what``, else it is said from the bounds)."""
    if what is None:
        what = ("a positive integer" if minimum == 1 else f"an integer >= {minimum}") if maximum is None \
            else f"an integer in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = what
    return parse


def seconds_above_zero(text: str) -> float:
    """An argparse ``type``: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value}")
    return value


def seconds_at_least_zero(text: str) -> float:
    """An argparse ``type``: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {value}")
    return value


def check_path(name: str, value: object) -> str:
    """``value`` as a non-empty file path (str or os.PathLike); errors name ``name``."""
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike; got {type(value).__name__}")
    text = os.fspath(value)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{name} must be a non-empty file path; got {value!r}")
    return text
