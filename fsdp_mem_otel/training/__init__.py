"""What runs inside training (needs torch): the tracker's lifecycle, the hot path the FSDP adapters
call (sink, recorder, ledger, saved-tensor accounting), deep mode, optimizer tracking, compile
support, the allocator probe; and, built on them, the demo training and ``estimate``."""
