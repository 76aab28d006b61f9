#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU (the H200 the device tool
# lends): the backend-agnostic suites on the GPU — the kernel suite, and the
# compute matrix end to end with agents sharing GPU 0 (collectives on one rank;
# the multi-rank collective paths are the cpu suite's) — then the GPU
# benchmarks. Writes a JSON summary to $1 (default $OUT/gpu-summary.json, or
# ./gpu-summary.json) and the logs beside it. Meant to finish in under 8 min.
#
# Binaries: from .gpu/bundle.tar.xz when it is there (tests/gpu/pack.sh makes
# it here: the device machine has CUDA but not meshd's Debian libraries),
# otherwise built from source (a machine with the .ci/install-deps packages).
#   bash tests/gpu/run.sh [summary.json]
# MESHD_GPU_DEVICE (default cuda:0) = cuda:emulated makes a dry run anywhere.
set -uo pipefail

cd "$(dirname "$0")/../.."
src=$PWD
out_dir=${OUT:-.}
summary=${1:-$out_dir/gpu-summary.json}
device=${MESHD_GPU_DEVICE:-cuda:0}
logs=$out_dir/gpu-logs
mkdir -p "$logs"
start=$(date +%s)
results=()

run_step() { # name, command...: its output in $logs/name.log and its tail here
  local name=$1 t0 rc
  t0=$(date +%s)
  shift
  echo "== $(date +%T) $name: $*"
  "$@" >"$logs/$name.log" 2>&1
  rc=$?
  tail -n 20 "$logs/$name.log"
  results+=("{\"step\":\"$name\",\"status\":\"$([ $rc -eq 0 ] && echo passed || echo "failed($rc)")\",\"seconds\":$(($(date +%s) - t0))}")
  return $rc
}

if [ "$device" != cuda:emulated ]; then
  nvidia-smi -L || { echo "no GPU here"; exit 77; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi

if [ -f .gpu/bundle.tar.xz ]; then
  prefix=$(mktemp -d)
  tar -C "$prefix" -xJf .gpu/bundle.tar.xz
  bin=$prefix/bin
  # CUDA's libraries as this machine has them (toolkit or Python wheels).
  cudalibs=$(find /usr /opt -xdev \( -name 'libcudart.so.13*' -o -name 'libcublas.so.13*' \
    -o -name 'libcublasLt.so.13*' -o -name 'libnccl.so.2*' \) -printf '%h\n' 2>/dev/null |
    sort -u | paste -sd:)
  export LD_LIBRARY_PATH=$prefix/lib${cudalibs:+:$cudalibs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$bin:$PATH
  echo "bundle: $bin; CUDA libraries from ${cudalibs:-the default paths}"
else
  build=${MESHD_GPU_BUILD:-build-gpu}
  run_step configure cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMESHD_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90
  run_step build cmake --build "$build" -j"$(nproc)"
  bin=$src/$build/bin
fi

run_step ldd sh -c "ldd $bin/meshd-agent | grep -E 'libcudart|libcublas|libnccl|not found';
  ! ldd $bin/meshd-agent | grep -q 'not found'"
# The kernel suite on the device, then the compute matrix with its agents on it.
run_step kernels env MESHD_TEST_DEVICE="$device" "$bin/test_backend_kernels" --jobs 1
run_step matrix env MESHD_BIN_DIR="$bin" MESHD_SOURCE_DIR="$src" MESHD_TEST_DEVICE="$device" \
  PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q -p no:cacheprovider -rs \
  "$src/tests/integration/test_compute_matrix.py"
# The GPU benchmarks: JSON lines with ratios against baselines of the same run.
bench_args=(--device "$device" --json "$out_dir/bench-gpu.jsonl")
[ "$device" = cuda:emulated ] && bench_args+=(--smoke)
run_step bench "$bin/bench_gpu" "${bench_args[@]}"

{
  echo "{"
  echo "  \"device\": \"$device\","
  echo "  \"gpu\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)\","
  echo "  \"seconds\": $(($(date +%s) - start)),"
  echo "  \"steps\": [$(IFS=,; echo "${results[*]}")],"
  echo -n "  \"bench\": ["
  if [ -s "$out_dir/bench-gpu.jsonl" ]; then paste -sd, "$out_dir/bench-gpu.jsonl"; fi
  echo "]"
  echo "}"
} >"$summary"
cat "$summary"
if grep -q failed "$summary"; then exit 1; fi
exit 0
