#!/usr/bin/env bash
# Compile-only check of the CUDA sources, for machines without a GPU (or a CUDA torch):
#   1. csrc/cuda/*.cu with nvcc for sm_80 and sm_90, warnings as errors;
#   2. csrc/cuda/*.cpp with g++ -fsyntax-only against the installed torch headers.
# Skips (exit 0) when nvcc is missing; fails on any compile error or warning.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [[ -z "$NVCC" ]]; then
  echo "compile_cuda: nvcc not found; skipping the CUDA compile check"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "compile_cuda: $("$NVCC" --version | tail -n 1)"
# Same rounding flags as setup.py (--fmad=false): the kernels must match the reference bit for bit.
for cu in csrc/cuda/*.cu; do
  "$NVCC" -c -O3 --fmad=false -std=c++17 -I csrc -DLBCOMM_WITH_CUDA=1 \
    -Xcompiler -Wall,-Wextra -Werror all-warnings \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
    "$cu" -o "$tmp/$(basename "$cu" .cu).o"
  echo "compile_cuda: $cu OK"
done

PYTHON="${PYTHON:-python}"
if ! torch_inc="$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))' 2>/dev/null)"; then
  echo "compile_cuda: torch is not importable with $PYTHON; skipping the ops_cuda.cpp syntax check"
  exit 0
fi
cuda_inc="$(dirname "$(dirname "$(readlink -f "$NVCC")")")/include"
[[ -f "$cuda_inc/cuda_runtime_api.h" ]] || cuda_inc=/usr/local/cuda/include

inc=(-I csrc -isystem "$cuda_inc")
for d in $torch_inc; do inc+=(-isystem "$d"); done
# A CPU build of torch ships the c10/cuda headers but not the generated
# c10/cuda/impl/cuda_cmake_macros.h (it only sets C10_CUDA_BUILD_SHARED_LIBS, which matters
# on Windows); C10_CUDA_NO_CMAKE_CONFIGURE_FILE is the headers' own switch to skip it.
for cpp in csrc/cuda/*.cpp; do
  "${CXX:-g++}" -fsyntax-only -std=c++17 -Wall -Wextra -Werror \
    -DLBCOMM_WITH_CUDA=1 -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -DPy_LIMITED_API=0x030A0000 \
    "${inc[@]}" "$cpp"
  echo "compile_cuda: $cpp syntax OK"
done
