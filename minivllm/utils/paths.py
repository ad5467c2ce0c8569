"""Where minivllm keeps files of its own: under the user's cache directory."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """`$XDG_CACHE_HOME/minivllm` (the freedesktop convention), else `~/.cache/minivllm`."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "minivllm")
