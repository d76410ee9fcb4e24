"""The log: what a light step queues until its flush, written and read here alone.

A light step does not apply its byte changes and step-recorder events as they happen: it appends them to one flat
list (``Counters.pending``), applied in order when the counters are first read (the *flush*) and run once more
when a report first reads its snapshots (the *replay*). Two kinds of entry, told apart by their first item:

- a *change*, 3 items: ``device`` (a ``str``: no other entry starts with one), category index, delta;
- an *event*, ``2 + n`` items: a bound method, ``n``, and its ``n`` arguments (the event's time last).

Each entry goes in with one ``list.extend`` of a tuple, a single C call: an entry queued from another thread (a
storage freed on autograd's) never lands inside another, and no tuple outlives the call for the cyclic collector
to count. Names and numbers only, never a tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def change(log: list[Any], device: str, cat: int, delta: int) -> None:
    """Queue ``delta`` bytes of category index ``cat`` on ``device``."""
    log.extend((device, cat, delta))


def event(log: list[Any], method: Callable[..., None], *args: Any) -> None:
    """Queue ``method(*args)`` (its time last among ``args``)."""
    log.extend((method, len(args), *args))


def take(log: list[Any], on_change: Callable[[str, int, int], None],
         on_event: Callable[[Callable[..., None], list[Any]], None], failures: list[Exception]) -> list[Any]:
    """Hand each entry of ``log``, in order, to ``on_change(device, cat, delta)`` or ``on_event(method, args)``, and
    take the entries handed off the log's front: returns them. Entries appended meanwhile (by another thread, or by
    an event) are handed too. An entry that raises is skipped alone (its exception goes to ``failures``); one that
    is no entry's head ends the walk, as where the next one starts is unknown."""
    i = 0
    try:
        while i < len(log):
            head = log[i]
            at = i
            try:
                if head.__class__ is str:
                    i += 3  # first: a change that fails is skipped alone
                    on_change(head, log[i - 2], log[i - 1])
                else:
                    n = log[i + 1]
                    i += 2 + n
                    on_event(head, log[i - n:i])
            except Exception as exc:  # noqa: BLE001 - hand on the rest
                failures.append(exc)
                if i == at:
                    i = len(log)
    finally:
        taken = log[:i]
        del log[:i]
    return taken
