"""Light mode's accounting engine: FSDP's, autograd's and the optimizer's events in, bytes per
device and category with per-module peaks out, on every step, with no per-op work.

Modules, in the order data flows:

- ``sink.py`` (``Sink``, with its base ``sink_bytes.LedgerCalls``): the ``EventSink`` the
  adapters call. Module states become recorder events; FSDP's buffers become ledger changes.
- ``activations.py``: the saved-tensor hooks that account what autograd saves for backward.
- ``ledger.py`` (``Ledger``): tracked storages, each an entry whose weak-reference callback takes
  its bytes out when it is freed; integer accounts for buffers FSDP's events size.
- ``counters.py`` (``Counters``, the ledger's base): bytes per device and category, the step's
  peak and nested peak windows; in light mode the *log* (below), applied at each *flush*.
- ``recorder.py`` (``StepRecorder``): module states in, the step's snapshots and windows out;
  ``StepReplay`` takes a light step's snapshots when a report first reads them.

Glossary (one word per concept):

- *change*: bytes added to or taken from one category on one device.
- *event*: a call of the step recorder's (a module state, a window edge), with its time.
- *log*: a light step's changes and events, queued in order in ``Counters.pending``: a change is
  ``device, category index, delta``; an event ``method, n, *n args`` (its time last). Nothing in it
  is a tensor.
- *flush*: applying the log to the counters, in order, when something first reads them (the
  optimizer hook, the step's end); the recorder then keeps each window's largest total alone.
- *replay*: running a flushed part of the log once more, through a recorder of its own, to take
  the step's snapshots when a report first reads them (``StepReplay``); a step nobody reads never
  takes them.
- *window*: the span of one module's forward or backward, whose peak the counters keep.
- *snapshot*: the counters at one module state (``Snap``: a flat tuple).
- *group account*: an FSDP2 group's buffers as integers moved by FSDP's events
  (``adapters/fsdp2_groups.py``), sized once from the tensors; the one thing learnt across steps
  is a buffer's size, never a step's figures.

Every step is measured on that step: nothing a step reports is taken from an earlier one.
"""
