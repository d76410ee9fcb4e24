"""Every environment variable fsdp_mem_otel reads, one constant each. Standard library only.

The package reads the environment only through these names (as opentelemetry-python's
``environment_variables`` module lists its own). How each is parsed is documented where it is
read: ``TrackerConfig.from_env`` and ``ExportConfig.from_env`` (``config.py``, whose ``TRACKER_ENV``
and ``EXPORT_ENV`` say what each accepts), ``Identity.from_env`` (``identity.py``),
``default_span_exporter`` (``exporters/otel.py``). Words are read case-insensitively (``Deep``,
``Auto``, ``True``).

A value that is not accepted: the direct API (``from_env``) raises ``ValueError`` naming the
variable; a launched job (``fsdp_mem_otel.run``, its bootstrap, the framework callbacks:
``config.read_env``) says so in one line on rank 0 and switches off only what the variable
configures (``FSDP_MEM_OTEL_ENABLED``: the tracking; the others keep their defaults).
"""

from __future__ import annotations

# -- how the tracker measures (TrackerConfig) ----------------------------------------------------
FSDP_MEM_OTEL_MODE = "FSDP_MEM_OTEL_MODE"
"""``light`` (default) or ``deep``."""
FSDP_MEM_OTEL_DEEP_EVERY = "FSDP_MEM_OTEL_DEEP_EVERY"
"""Run every Nth step deep; 0 (default) never."""
FSDP_MEM_OTEL_MAX_ERRORS = "FSDP_MEM_OTEL_MAX_ERRORS"
"""Internal failures after which the tracker detaches itself (default 100; 0 never)."""
FSDP_MEM_OTEL_ENABLED = "FSDP_MEM_OTEL_ENABLED"
"""``0``/``false``: the tracker does nothing and opens no exporter (a value not accepted: off too, said
once under the launcher)."""
FSDP_MEM_OTEL_RESET_PEAKS = "FSDP_MEM_OTEL_RESET_PEAKS"
"""``0``: never reset the CUDA allocator's peak counters (light mode then misses op temporaries);
``1``: reset them at every window edge and step end; ``auto`` or unset (default): ``1`` where CUDA
is available. The training script's own peak readers are shadowed either way (``shadow_peaks.py``)."""
FSDP_MEM_OTEL_ACTIVATIONS = "FSDP_MEM_OTEL_ACTIVATIONS"
"""``0``: light mode does not account saved activations (saved-tensor hooks off)."""
FSDP_MEM_OTEL_DEEP_WHEN_COMPILED = "FSDP_MEM_OTEL_DEEP_WHEN_COMPILED"
"""``skip`` (default) or ``eager``: what a deep step does on a model with compiled regions."""

# -- switching it on for a fleet (fsdp_mem_otel.run and its bootstrap) ------------------------------
FSDP_MEM_OTEL_AUTO = "FSDP_MEM_OTEL_AUTO"
"""``1``: with ``PYTHONPATH`` at ``fsdp_mem_otel/bootstrap``, every Python process attaches the
tracker to its FSDP root automatically, as ``python -m fsdp_mem_otel.run`` does (read by
``fsdp_mem_otel/bootstrap/sitecustomize.py``, which imports nothing else of the package)."""
FSDP_MEM_OTEL_QUIET = "FSDP_MEM_OTEL_QUIET"
"""``1``: ``fsdp_mem_otel.run`` (and its bootstrap) does not say what it tracks and where at the
first forward, nor how many step reports went where at exit (rank 0 says both otherwise). A
setting that is not accepted, a port in use or a JSONL file that cannot be written is still said,
in one line."""
FSDP_MEM_OTEL_LEAK_WINDOW = "FSDP_MEM_OTEL_LEAK_WINDOW"
"""Step ends the leak detector looks back at (default 30, at least 10; a category that never fell
over them and rose at 5 or more, and at half or more, is reported as growing)."""

# -- where reports go (ExportConfig) ---------------------------------------------------------------
FSDP_MEM_OTEL_PROMETHEUS = "FSDP_MEM_OTEL_PROMETHEUS"
"""Per-rank /metrics endpoint on (default) or off. Not accepted, or a bad ``PROMETHEUS_*`` /
``TLS_*`` setting, in a launched job: the endpoint is off."""
FSDP_MEM_OTEL_PROMETHEUS_PORT = "FSDP_MEM_OTEL_PROMETHEUS_PORT"
"""Base port (default 9400); a rank serves base + LOCAL_RANK."""
FSDP_MEM_OTEL_PROMETHEUS_ADDR = "FSDP_MEM_OTEL_PROMETHEUS_ADDR"
"""Bind address of the per-rank endpoint (default 0.0.0.0)."""
FSDP_MEM_OTEL_TLS_CERTFILE = "FSDP_MEM_OTEL_TLS_CERTFILE"
"""Serve HTTPS with this certificate (PEM)."""
FSDP_MEM_OTEL_TLS_KEYFILE = "FSDP_MEM_OTEL_TLS_KEYFILE"
"""The certificate's private key (PEM)."""
FSDP_MEM_OTEL_TLS_CLIENT_CAFILE = "FSDP_MEM_OTEL_TLS_CLIENT_CAFILE"
"""Require client certificates signed by this CA (mutual TLS)."""
FSDP_MEM_OTEL_DETAIL = "FSDP_MEM_OTEL_DETAIL"
"""Also export module x state x category bytes (many series)."""
FSDP_MEM_OTEL_DETAIL_TOP_K = "FSDP_MEM_OTEL_DETAIL_TOP_K"
"""With detail on: the K modules with the largest peaks get detail series (default 8)."""
FSDP_MEM_OTEL_ESTIMATE = "FSDP_MEM_OTEL_ESTIMATE"
"""JSONL written by ``fsdp-mem-otel estimate``: exported beside the measured figures."""
FSDP_MEM_OTEL_SIDECAR_DIR = "FSDP_MEM_OTEL_SIDECAR_DIR"
"""Write ``rank-<rank>.prom`` there for ``fsdp-mem-otel serve``."""
FSDP_MEM_OTEL_SIDECAR_INTERVAL = "FSDP_MEM_OTEL_SIDECAR_INTERVAL"
"""Rewrite the sidecar file at most every this many seconds (default 15; 0: every step)."""
FSDP_MEM_OTEL_JSONL = "FSDP_MEM_OTEL_JSONL"
"""Append StepReports as JSON lines to this path (``{rank}`` is filled in). Without ``{rank}``, in a
job of several ranks, each rank writes its own file, ``.rank<N>`` before the extension
(``run.jsonl`` -> ``run.rank0.jsonl``, ``run.rank1.jsonl``). A bad ``JSONL_*`` setting in a launched
job, or a path that cannot be written: JSONL off (the rest goes on)."""
FSDP_MEM_OTEL_JSONL_MODULES_EVERY = "FSDP_MEM_OTEL_JSONL_MODULES_EVERY"
"""Module snapshots in the JSONL line of step 1, every Nth, deep, aborted and changed steps (default 100)."""
FSDP_MEM_OTEL_JSONL_MAX_BYTES = "FSDP_MEM_OTEL_JSONL_MAX_BYTES"
"""Rotate the JSONL file before it passes this size (default 256 MiB; 0: never)."""
FSDP_MEM_OTEL_JSONL_BACKUP_COUNT = "FSDP_MEM_OTEL_JSONL_BACKUP_COUNT"
"""Rotated JSONL files kept (default 5)."""
FSDP_MEM_OTEL_JSONL_COMPRESS = "FSDP_MEM_OTEL_JSONL_COMPRESS"
"""gzip each rotated JSONL file (``run.jsonl.1.gz``; default 1, 0 keeps them plain)."""
FSDP_MEM_OTEL_SPANS_EVERY = "FSDP_MEM_OTEL_SPANS_EVERY"
"""OpenTelemetry spans for step 1 and every Nth step (default 1)."""
FSDP_MEM_OTEL_MODULE_SPANS_EVERY = "FSDP_MEM_OTEL_MODULE_SPANS_EVERY"
"""Module spans (and their state events) on step 1, every Nth step and aborted steps (default 1000)."""
FSDP_MEM_OTEL_OTEL_CONSOLE = "FSDP_MEM_OTEL_OTEL_CONSOLE"
"""``1``: print spans to stdout when no OTLP endpoint is set."""
FSDP_MEM_OTEL_JOB = "FSDP_MEM_OTEL_JOB"
"""The ``job_name`` label / resource attribute; wins over the torchrun and pod names."""
FSDP_MEM_OTEL_SIGTERM = "FSDP_MEM_OTEL_SIGTERM"
"""``0``: do not install the SIGTERM handler that flushes the exporters before the process ends."""

# -- OpenTelemetry's standard variables (the SDK reads the rest: OTEL_EXPORTER_OTLP_HEADERS, ...) --
OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Base URL of an OTLP/HTTP receiver; spans go to ``<url>/v1/traces``. Spans are on when set."""
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""Full URL of the traces endpoint (wins over the base URL)."""
OTEL_EXPORTER_OTLP_TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"
"""Seconds per export request (default here: 5)."""
OTEL_EXPORTER_OTLP_TRACES_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
"""The same, traces only; wins."""
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
"""``true``: no spans at all."""
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
"""``service.name`` of the resource (default ``fsdp-mem-otel``)."""

# -- set by torchrun ---------------------------------------------------------------------------------
RANK = "RANK"
"""Global rank."""
LOCAL_RANK = "LOCAL_RANK"
"""Rank on this node: selects the Prometheus port (base + LOCAL_RANK)."""
WORLD_SIZE = "WORLD_SIZE"
"""Number of ranks."""
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
"""torchrun's rendezvous id: the job name unless FSDP_MEM_OTEL_JOB is set (``none`` is ignored)."""

# -- set by the Kubernetes downward API (in the pod spec) -----------------------------------------
POD_NAME = "POD_NAME"
"""The pod's name (label ``pod``; the job name without its replica suffix as a fallback)."""
POD_NAMESPACE = "POD_NAMESPACE"
"""The pod's namespace (label ``namespace``)."""
NODE_NAME = "NODE_NAME"
"""The node's name (resource attribute ``k8s.node.name``)."""
POD_UID = "POD_UID"
"""The pod's uid (resource attribute ``k8s.pod.uid``)."""

# -- PyTorch's ---------------------------------------------------------------------------------------
PYTORCH_NO_CUDA_MEMORY_CACHING = "PYTORCH_NO_CUDA_MEMORY_CACHING"
"""``1``: no caching allocator, so CUDA tensors are not rounded to 512-byte blocks."""
