"""What runs inside training (needs torch): the tracker's lifecycle, the hot path the FSDP adapters call (sink,
recorder, ledger, saved-tensor accounting), deep mode, optimizer tracking, compile support, the allocator probe.
What is built on them (``estimate``, ``--fit``, the demo) lives in ``fsdp_mem_otel.tools``, never imported here."""
