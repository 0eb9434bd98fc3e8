#!/usr/bin/env bash
# Build llama-bench from the stripped llama.cpp tree (benchmarks/peers/fetch_llama_cpp.sh).
#
# Usage: bash benchmarks/peers/build_llama_bench.sh cpu|cpu-xeon|cuda|cuda-native [--configure-only]
#   cpu          CPU backend for this machine (GGML_NATIVE=ON)                 -> .peers/bin/llama-bench-cpu
#   cpu-xeon     CPU backend only, for a Sapphire-Rapids-class Xeon (the flags of cuda below), built
#                anywhere: the GPU host's CPU-only comparison without the CUDA build -> .peers/bin/llama-bench-cpu-xeon
#   cuda         CUDA backend for sm_90 (H100/H200) + a CPU backend for a Sapphire-Rapids-class Xeon
#                (AVX-512 F/BW/DQ/VL/VBMI/VNNI/BF16, AVX-VNNI, AMX), built anywhere nvcc is  -> .peers/bin/llama-bench-cuda
#                and, to carry to the GPU host (carry .peers/xfer), .peers/xfer/llama-bench-cuda.xz (+ .needs)
#   cuda-native  CUDA backend for sm_90 + the CPU backend for this machine's CPU (on the GPU host itself)
#                                                                                -> .peers/bin/llama-bench-cuda
# Beside the binary, NAME.needs lists the /proc/cpuinfo flags its CPU backend was compiled for (empty for a
# native build); benchmarks/peers/run.py checks them. --configure-only stops after cmake's configure step.
# The build folder (.peers/build-KIND) is incremental: a build stopped part-way resumes where it stopped.
# Static ggml/llama libraries and libstdc++, so one stripped binary travels; at run time it needs
# libcudart.so.13, libcublas.so.13, libcublasLt.so.13 (CUDA toolkit or pip's nvidia-cublas), libcuda.so.1
# (the driver) and libgomp.so.1.
# Env: JOBS (default: all cores), CUBLAS_ROOT (a folder holding lib/libcublas.so.13 and include/cublas_v2.h;
# default: the first nvidia/cu13 found on python3's sys.path or under .peers/cuda, else the CUDA toolkit's).
set -euo pipefail
KIND=${1:?usage: build_llama_bench.sh cpu|cpu-xeon|cuda|cuda-native [--configure-only]}
CONFIGURE_ONLY=0
[ "${2:-}" = --configure-only ] && CONFIGURE_ONLY=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
P="$ROOT/.peers"
JOBS=${JOBS:-$(nproc)}
export GIT_CEILING_DIRECTORIES="$P"  # git must not report the enclosing repository as llama.cpp's commit
SRC="$P/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  [ -f "$P/carry/llama.cpp-src.tar.gz" ] || { echo "no $SRC and no $P/carry/llama.cpp-src.tar.gz: run benchmarks/peers/fetch_llama_cpp.sh" >&2; exit 2; }
  tar -C "$P" -xzf "$P/carry/llama.cpp-src.tar.gz"
fi
COMMIT=$(awk '$1=="llama.cpp"{print $2}' "$SRC/PEERS_VERSION")
COMMON=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF
        -DLLAMA_BUILD_COMMIT="$COMMIT" -DLLAMA_BUILD_NUMBER=0
        "-DCMAKE_EXE_LINKER_FLAGS=-static-libstdc++ -static-libgcc")
# Sapphire Rapids-class x86-64 (the GPU host's Xeon); AVX2/FMA/F16C/BMI2 are on by default with GGML_NATIVE=OFF
XEON_NEEDS="avx512f avx512bw avx512dq avx512vl avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16"
XEON=(-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
      -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON)

find_cublas() {
  if [ -n "${CUBLAS_ROOT:-}" ]; then echo "$CUBLAS_ROOT"; return; fi
  local d
  for d in $(python3 -c 'import sys; print(" ".join(p for p in sys.path if p))' 2>/dev/null) "$P/cuda"; do
    if [ -f "$d/nvidia/cu13/lib/libcublas.so.13" ] && [ -f "$d/nvidia/cu13/include/cublas_v2.h" ]; then
      echo "$d/nvidia/cu13"; return
    fi
  done
  d=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  if ls "$d"/lib64/libcublas.so* >/dev/null 2>&1; then echo "$d"; return; fi
  echo "cuBLAS not found: set CUBLAS_ROOT, or unpack pip's nvidia-cublas wheel (13.x) into .peers/cuda" >&2
  exit 2
}

case "$KIND" in
cpu|cpu-xeon)
  B="$P/build-$KIND"
  if [ "$KIND" = cpu ]; then CPUFLAGS=(-DGGML_NATIVE=ON); NEEDS=; else CPUFLAGS=("${XEON[@]}"); NEEDS=$XEON_NEEDS; fi
  cmake -S "$SRC" -B "$B" "${COMMON[@]}" "${CPUFLAGS[@]}"
  [ "$CONFIGURE_ONLY" = 1 ] && exit 0
  cmake --build "$B" --target llama-bench -j "$JOBS"
  mkdir -p "$P/bin"
  OUTBIN="$P/bin/llama-bench-$KIND"
  strip -o "$OUTBIN" "$B/bin/llama-bench"
  echo "$NEEDS" > "$OUTBIN.needs" ;;
cuda|cuda-native)
  B="$P/build-$KIND"
  CB=$(find_cublas)
  LINK="$B/link"   # unversioned names for the linker (pip wheels ship only the .so.13 files)
  mkdir -p "$LINK"
  ln -sf "$(ls "$CB"/lib*/libcublas.so.13 | head -1)" "$LINK/libcublas.so"
  ln -sf "$(ls "$CB"/lib*/libcublasLt.so.13 | head -1)" "$LINK/libcublasLt.so"
  # the driver: the system's libcuda.so.1 where there is one, else a link stub generated from the
  # cu* symbols ggml-cuda references (the binary records the soname libcuda.so.1 either way)
  DRIVER=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*x86-64/{print $NF; exit}')
  STUB=0
  if [ -z "$DRIVER" ]; then
    STUB=1
    DRIVER="$LINK/libcuda.so"
    [ -f "$DRIVER" ] || { echo "" | gcc -x c -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$DRIVER" -; }
  fi
  if [ "$KIND" = cuda ]; then CPUFLAGS=("${XEON[@]}"); NEEDS=$XEON_NEEDS; else CPUFLAGS=(-DGGML_NATIVE=ON); NEEDS=; fi
  cmake -S "$SRC" -B "$B" "${COMMON[@]}" "${CPUFLAGS[@]}" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
        -DGGML_CUDA_NCCL=OFF -DCUDA_cublas_LIBRARY="$LINK/libcublas.so" -DCUDA_cublasLt_LIBRARY="$LINK/libcublasLt.so" \
        -DCUDA_cuda_driver_LIBRARY="$DRIVER" \
        "-DCMAKE_CUDA_FLAGS=-I$CB/include" "-DCMAKE_CXX_FLAGS=-I$CB/include"
  [ "$CONFIGURE_ONLY" = 1 ] && exit 0
  if [ "$STUB" = 1 ]; then
    cmake --build "$B" --target ggml-cuda -j "$JOBS"
    nm -u "$B"/ggml/src/ggml-cuda/libggml-cuda.a | awk '{print $2}' | grep -E '^cu[A-Z]' | sort -u \
      | sed 's/.*/void &(void) {}/' | gcc -x c -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$DRIVER" -
  fi
  cmake --build "$B" --target llama-bench -j "$JOBS"
  mkdir -p "$P/bin"
  OUTBIN="$P/bin/llama-bench-cuda"
  strip -o "$OUTBIN" "$B/bin/llama-bench"
  echo "$NEEDS" > "$OUTBIN.needs"
  if [ "$KIND" = cuda ]; then  # the form that travels to the GPU host: ~22 MB instead of ~51 (run.sh unpacks it)
    mkdir -p "$P/xfer"
    xz -T0 -6 -c "$OUTBIN" > "$P/xfer/llama-bench-cuda.xz"
    cp "$OUTBIN.needs" "$P/xfer/llama-bench-cuda.needs"
  fi ;;
*) echo "unknown kind $KIND (cpu|cpu-xeon|cuda|cuda-native)" >&2; exit 2 ;;
esac
echo "built $OUTBIN: $(du -h "$OUTBIN" | cut -f1)"
ldd "$OUTBIN" || true
