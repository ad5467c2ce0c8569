"""A deeper fuzzing run of `minivllm serve` than CI's, for humans.

    python tools/fuzz_server.py --examples 500

Runs tests/test_fuzz.py (schemathesis against the server's OpenAPI document with
the API key on, and hypothesis on `SamplingParams` and the request models) with
`--examples` generated requests per route (CI uses 12) and fresh random examples
each run; hypothesis prints a failing example in a form that reproduces it.
Takes ~1 minute per 100 examples per route on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--examples", type=int, default=200, help="requests per route (default: %(default)s)"
    )
    args = parser.parse_args()
    env = {**os.environ, "MINIVLLM_FUZZ_EXAMPLES": str(args.examples)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz.py"]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
