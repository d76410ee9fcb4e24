"""Former name of ``fsdp_mem_otel.schema`` (the report schema), kept so old imports work."""

from fsdp_mem_otel.schema import *  # noqa: F403
