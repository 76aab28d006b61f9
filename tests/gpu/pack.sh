#!/usr/bin/env bash
# Packs what tests/gpu/run.sh needs on a GPU machine that has the CUDA toolkit
# but none of meshd's Debian libraries (the device tool's H200 image: nothing
# can be installed there): a Release build with the cuda backend for sm_90,
# the binaries the GPU checks run, protoc (the Python tests generate their
# modules with it), and every shared library those load that is neither the C
# runtime nor CUDA's (the GPU machine brings its own cudart, cuBLAS and NCCL),
# into .gpu/bundle.tar.xz, which git ignores. Then, with the device tool:
#   run  command: "bash tests/gpu/run.sh"  carry: [".gpu"]  timeout_s: 480
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${MESHD_GPU_PACK_BUILD:-build-gpu-pack}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMESHD_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
bins="meshd meshd-agent meshctl test_backend_kernels bench_gpu"
# shellcheck disable=SC2086
cmake --build "$build" -j"$(nproc)" --target $bins
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for b in $bins; do cp "$build/bin/$b" "$stage/bin/"; done
cp "$(command -v protoc)" "$stage/bin/"
for f in "$stage"/bin/*; do ldd "$f"; done | awk '/=>/ {print $3}' | sort -u |
  grep -vE '/(libc|libm|libpthread|libdl|librt|libresolv|libutil)\.so|ld-linux|libstdc\+\+|libgcc_s|/cuda' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
mkdir -p .gpu
tar -C "$stage" -cJf .gpu/bundle.tar.xz bin lib
ls -la .gpu/bundle.tar.xz
