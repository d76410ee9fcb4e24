"""Tools built on the tracker: ``estimate`` (a job's memory before launch, under FakeTensorMode),
its ``--fit`` search and ``--compare-options`` (``estimate_fit``), and the demo training (``demo``).

They may import ``training/`` (and the exporters, fleet and offline parts); ``training/`` never
imports them. Within: ``estimate_fit`` imports ``estimate``, never the reverse; ``estimate_cli``
(the ``fsdp-mem-otel estimate`` command) imports both."""
