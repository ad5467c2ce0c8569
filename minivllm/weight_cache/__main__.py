"""`python -m minivllm.weight_cache MODEL [engine flags] [--socket-dir DIR]`."""

import sys

from minivllm.entrypoints.weight_cache_cli import main

sys.exit(main())
