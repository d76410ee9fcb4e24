"""The folder to put on ``PYTHONPATH`` (with ``FSDP_MEM_OTEL_AUTO=1``) to track every training
process it starts without changing its command: see ``sitecustomize.py`` here and docs/launcher.md."""
