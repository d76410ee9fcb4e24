"""Ready-made callbacks for training frameworks: ``hf`` (transformers Trainer) and ``lightning``.

Each builds its tracker from the environment, like ``FSDPMemoryTracker.from_env`` (or from an
explicit ``config`` / ``exporters``), attaches once the framework has wrapped the model with FSDP,
closes one step per optimizer step (also under gradient accumulation) while the gradients are
still alive, and accounts each batch as ``inputs``. Neither framework is needed by the core
install: ``pip install fsdp-mem-otel[hf]`` or ``fsdp-mem-otel[lightning]``.
"""
