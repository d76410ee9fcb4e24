"""Light mode's accounting engine: FSDP's, autograd's and the optimizer's events in, bytes per device and category
with per-module peaks out, every step, no per-op work. Modules, in the order data flows:

- ``sink.py`` (``Sink``, base ``sink_bytes.LedgerCalls``): the adapters' ``EventSink``, feeding the two below.
- ``activations.py``: saved-tensor hooks accounting what autograd saves for backward.
- ``ledger.py`` (``Ledger``): tracked storages (weak-reference callbacks) and integer accounts.
- ``counters.py`` (``Counters``, the ledger's base): bytes per device and category, peaks, the *log*.
- ``log.py``: the log's two kinds of entry, written (``change``, ``event``) and read (``take``) there alone.
- ``recorder.py`` (``StepRecorder``, ``StepReplay``): module states in, the step's snapshots and windows out.

Glossary:
- *change*: bytes added to or taken from one category on one device.
- *event*: a call of the step recorder's (a module state, a window edge), with its time.
- *log*: a light step's changes (``device, category index, delta``) and events (``method, n, *n args``, time last),
  in order, in ``Counters.pending``; never a tensor.
- *flush*: applying the log when the counters are first read (optimizer hook, step end); windows keep totals alone.
- *replay*: re-running flushed parts of the log through a recorder of its own when a report first reads the
  snapshots (``StepReplay``); a step nobody reads never takes them.
- *window*: the span of one module's forward or backward, whose peak the counters keep.
- *snapshot*: the counters at one module state (``Snap``: a flat tuple).
- *record*: the step recorder's snapshots in order (module key, state, counters, time: parallel lists).
- *group account*: an FSDP2 group's buffers as integers moved by FSDP's events (``adapters/fsdp2_groups.py``); only
  their sizes carry over steps.

Every step is measured on that step: nothing a step reports is taken from an earlier one."""
