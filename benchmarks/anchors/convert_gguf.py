"""Convert a local HF checkpoint to GGUF with llama.cpp's own converter (not run by CI).

    python convert_gguf.py --converter-dir SRC/vendor/llama.cpp MODEL_DIR --outtype bf16 --outfile X.gguf

SRC is the extracted llama-cpp-python sdist; everything after --converter-dir DIR goes to
convert_hf_to_gguf.py unchanged.  Two adjustments, both outside the converter's code:
  * its vendored gguf-py is put first on sys.path (PyPI's `gguf` can lag behind the converter);
  * our random test checkpoints carry a small locally trained byte-level BPE tokenizer whose hash is
    not in the converter's table, so an unknown hash is mapped to the "gpt-2" pre-tokenizer (the same
    byte-level split) instead of raising.  Benchmarks feed token ids, so this never affects timings.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    argv = sys.argv[1:]
    k = argv.index("--converter-dir")
    src = os.path.abspath(argv[k + 1])
    rest = argv[:k] + argv[k + 2 :]
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    script = os.path.join(src, "convert_hf_to_gguf.py")
    try:
        import conversion.base as base  # newer converters keep the model classes in a package

        holder = base.TextModel
    except ImportError:
        holder = None
    if holder is not None:
        _patch(holder)
        sys.argv = [script, *rest]
        runpy.run_path(script, run_name="__main__")
    else:  # single-file converter: patch its TextModel after import, then call its main()
        sys.argv = [script, *rest]
        mod = runpy.run_path(script, run_name="convert_hf_to_gguf")
        _patch(mod["TextModel"])
        mod["main"]()


def _patch(cls) -> None:
    original = cls.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print("convert_gguf: unknown BPE pre-tokenizer hash, using 'gpt-2'", file=sys.stderr)
            return "gpt-2"

    cls.get_vocab_base_pre = get_vocab_base_pre


if __name__ == "__main__":
    main()
