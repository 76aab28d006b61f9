#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU (the H100 or H200 the device
# tool lends): the backend-agnostic suites on the GPU — the kernel suite, and the
# compute matrix end to end with agents sharing GPU 0 (collectives on one rank:
# NCCL refuses two ranks of one host on one GPU) — then the GPU benchmarks, and
# last the NCCL paths with three agents on the GPU, each a host of its own to NCCL
# (test_compute_matrix.py's nccl_host_of_its_own; bounded by NCCL_STEP_S). Writes
# a JSON summary to $1 (default $OUT/gpu-summary.json, or ./gpu-summary.json)
# with every step's status, time and last lines, and the logs beside it. Meant
# to finish in under 8 min.
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

# The Python the matrix runs on: the first with pytest, grpc and numpy (the GPU
# image's python3 is first on PATH; a Debian machine's is /usr/bin/python3).
py=python3
for p in python3 /usr/bin/python3; do
  if "$p" -c 'import pytest, grpc, numpy' >/dev/null 2>&1; then py=$p; break; fi
done
# A JSON string of stdin.
json_str() { "$py" -c 'import json, sys; print(json.dumps(sys.stdin.read()))' 2>/dev/null || echo '""'; }

run_step() { # name, command...: its output in $logs/name.log, its tail here and in the summary
  local name=$1 t0 rc
  t0=$(date +%s)
  shift
  echo "== $(date +%T) $name: $*"
  "$@" >"$logs/$name.log" 2>&1
  rc=$?
  tail -n 20 "$logs/$name.log"
  results+=("{\"step\":\"$name\",\"status\":\"$([ $rc -eq 0 ] && echo passed || echo "failed($rc)")\",\"seconds\":$(($(date +%s) - t0)),\"tail\":$(tail -n 40 "$logs/$name.log" | json_str)}")
  return $rc
}

if [ "$device" != cuda:emulated ]; then
  nvidia-smi -L || { echo "no GPU here"; exit 77; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi

if [ -f .gpu/bundle.tar.xz ]; then
  prefix=$(mktemp -d)
  trap 'rm -rf "$prefix"' EXIT
  tar -C "$prefix" -xJf .gpu/bundle.tar.xz
  bin=$prefix/bin
  # CUDA's libraries as this machine has them (toolkit or Python wheels).
  # (No -xdev: a Python environment under /opt may be a mount of its own.)
  cudalibs=$(find /usr /opt \( -name 'libcudart.so.13*' -o -name 'libcublas.so.13*' \
    -o -name 'libcublasLt.so.13*' -o -name 'libnccl.so.2*' \) -printf '%h\n' 2>/dev/null |
    sort -u | paste -sd:)
  export LD_LIBRARY_PATH=$prefix/lib${cudalibs:+:$cudalibs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$bin:$PATH
  echo "bundle: $bin; CUDA libraries from ${cudalibs:-the default paths}"
else
  build=${MESHD_GPU_BUILD:-build-gpu}
  run_step configure cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMESHD_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90
  # What the steps run (pack.sh's list), not every suite of the tree.
  run_step build cmake --build "$build" -j"$(nproc)" --target meshd meshd-agent meshctl \
    test_backend_kernels bench_gpu
  bin=$src/$build/bin
fi

run_step ldd sh -c "ldd $bin/meshd-agent | grep -E 'libcudart|libcublas|libnccl|not found';
  ! ldd $bin/meshd-agent | grep -q 'not found'"
# The kernel suite on the device, then the compute matrix with its agents on it.
run_step kernels env MESHD_TEST_DEVICE="$device" "$bin/test_backend_kernels" --jobs 1
matrix=(env MESHD_BIN_DIR="$bin" MESHD_SOURCE_DIR="$src" MESHD_TEST_DEVICE="$device"
  PYTHONDONTWRITEBYTECODE=1 "$py" -m pytest -q -p no:cacheprovider -rs
  "$src/tests/integration/test_compute_matrix.py")
run_step matrix "${matrix[@]}" -k "not nccl_paths"
# The GPU benchmarks: JSON lines with ratios against baselines of the same run.
bench_args=(--device "$device" --json "$out_dir/bench-gpu.jsonl")
[ "$device" = cuda:emulated ] && bench_args+=(--smoke)
run_step bench "$bin/bench_gpu" "${bench_args[@]}"
# Last, as it may hang where NCCL cannot join the two agents: a step of its own,
# bounded, with NCCL's warnings in the agents' logs (pytest prints them on failure).
run_step nccl timeout -s INT -k 20 "${NCCL_STEP_S:-150}" env NCCL_DEBUG=WARN "${matrix[@]}" -k nccl_paths

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
