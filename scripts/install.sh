#!/usr/bin/env bash
# Install minivllm for CPU machines: README's first command and CI's first step.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch from its CPU wheel index: on an ordinary Linux machine a plain `pip install torch`
# downloads the CUDA build and its CUDA libraries (GBs). (Where pip is set up with a local
# wheel, as on this project's machines, the unreachable index costs a few seconds.)
python -m pip install --quiet "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
python -m pip install --quiet -e ".[dev]"
# xgrammar (structured output, tool calls) without triton, a 285 MB dependency that only
# its GPU path uses; its CPU dependencies (apache-tvm-ffi, pydantic) are minivllm's own.
python -m pip install --quiet --no-deps "xgrammar>=0.2.8"
