"""``python -m fsdp_mem_otel <command>``: the ``fsdp-mem-otel`` command."""

import sys

from fsdp_mem_otel.cli import main

sys.exit(main())
