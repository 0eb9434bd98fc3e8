#!/usr/bin/env bash
# Fetch llama.cpp's source from the llama-cpp-python source distribution and strip it to what
# llama-bench (CPU and CUDA backends) and convert_hf_to_gguf.py / gguf-py need.
#
# Usage: bash benchmarks/peers/fetch_llama_cpp.sh [VERSION [TOKENIZER_DIR]]     (default version: 0.3.36)
# TOKENIZER_DIR: a real Qwen3 tokenizer (tokenizer.json, tokenizer_config.json), copied for the checkpoint;
# llama.cpp's converter only accepts pre-tokenizers it knows, so make_model's own tokenizer will not do.
# Writes (under the repository's ignored .peers/):
#   .peers/dl/llama_cpp_python-VERSION.tar.gz   the sdist as downloaded (pip download --no-binary)
#   .peers/llama.cpp/                           the stripped vendored tree (+ PEERS_VERSION)
#   .peers/carry/llama.cpp-src.tar.gz           the same tree packed, for the GPU host (~4 MB)
#   .peers/carry/tokenizer/                      TOKENIZER_DIR's files (11 MB), when given
# Needs network (PyPI); the GPU host never runs this, it unpacks the carried tarball.
set -euo pipefail
VERSION=${1:-0.3.36}
TOKENIZER=${2:-}
if [ -n "$TOKENIZER" ]; then  # absolute: the script changes directory before it copies the files
  TOKENIZER=$(cd "$TOKENIZER" && pwd)
fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
P="$ROOT/.peers"
mkdir -p "$P/dl" "$P/carry"
SDIST="$P/dl/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  # the sdist's metadata is prepared without build isolation, with its build backend from this environment
  python3 -c "import scikit_build_core" 2>/dev/null || {
    echo "fetch_llama_cpp.sh: needs scikit-build-core to read the sdist's metadata: pip install scikit-build-core" >&2
    exit 1
  }
  python3 -m pip download --no-binary :all: --no-deps --no-build-isolation -d "$P/dl" "llama-cpp-python==$VERSION"
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
tar -xzf "$SDIST" -C "$TMP"
SRC="$TMP/llama_cpp_python-$VERSION"
T="$SRC/vendor/llama.cpp"
# the llama.cpp commit the sdist vendors, from its changelog entry ("update llama.cpp to ggml-org/llama.cpp@SHA")
COMMIT=$(awk -v v="## [$VERSION]" '$0==v{f=1;next} /^## \[/{f=0} f && match($0,/llama\.cpp@[0-9a-f]+/){print substr($0,RSTART+10,RLENGTH-10); exit}' "$SRC/CHANGELOG.md")

cd "$T"
# not needed by llama-bench, convert_hf_to_gguf.py or gguf-py
rm -rf .git .github .devops .gemini .pi app benches ci docs examples grammars media models pocs \
       requirements scripts skills tests build-xcframework.sh flake.nix AGENTS.md CLAUDE.md \
       convert_hf_to_gguf_update.py convert_llama_ggml_to_gguf.py convert_lora_to_gguf.py
# tools: llama-bench only (tools/CMakeLists.txt adds the others unconditionally)
find tools -mindepth 1 -maxdepth 1 ! -name llama-bench ! -name CMakeLists.txt -exec rm -rf {} +
cat > tools/CMakeLists.txt <<'CMK'
# stripped by edgemoe's benchmarks/peers/fetch_llama_cpp.sh: llama-bench only
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
CMK
# ggml backends other than CPU and CUDA (each is only added when its GGML_<NAME> option is on)
for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "ggml/src/ggml-$b"
done
rm -rf ggml/src/ggml-cpu/kleidiai ggml/src/ggml-cpu/spacemit gguf-py/gguf/scripts/gguf_editor_gui.py
printf 'llama-cpp-python %s\nllama.cpp %s\n' "$VERSION" "${COMMIT:-unknown}" > PEERS_VERSION

rm -rf "$P/llama.cpp"
cp -a "$T" "$P/llama.cpp"
tar -C "$P" -czf "$P/carry/llama.cpp-src.tar.gz" llama.cpp
echo "llama.cpp from llama-cpp-python $VERSION (commit ${COMMIT:-unknown}): $(du -sh "$P/llama.cpp" | cut -f1) unpacked," \
     "$(du -h "$P/carry/llama.cpp-src.tar.gz" | cut -f1) packed at .peers/carry/llama.cpp-src.tar.gz"
if [ -n "$TOKENIZER" ]; then
  mkdir -p "$P/carry/tokenizer"
  cp "$TOKENIZER"/tokenizer.json "$TOKENIZER"/tokenizer_config.json "$P/carry/tokenizer/"
  chmod u+w "$P/carry/tokenizer"/*
  echo "tokenizer from $TOKENIZER at .peers/carry/tokenizer"
fi
