"""Console logging for the command-line entry points."""

from __future__ import annotations

import logging
import sys


def setup_logging() -> None:
    """minivllm's records to stderr, timestamped, at INFO."""
    logger = logging.getLogger("minivllm")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s minivllm: %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
