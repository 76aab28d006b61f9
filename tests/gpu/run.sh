#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU (e.g. the H200 the device
# tool lends): builds with the cuda backend, runs the backend-agnostic suites
# on cuda:0 (the kernel suite, and the compute matrix end to end with agents
# sharing GPU 0: collectives on one rank; the multi-rank collective paths are
# the cpu suite's), the NCCL paths that one GPU allows, and the GPU benchmarks.
# Writes a JSON summary to $1 (default: $OUT/gpu-summary.json, or
# ./gpu-summary.json). Meant to finish in under 8 minutes.
#
#   bash tests/gpu/run.sh [summary.json]
set -uo pipefail

cd "$(dirname "$0")/../.."
out_dir=${OUT:-.}
summary=${1:-$out_dir/gpu-summary.json}
build=${MESHD_GPU_BUILD:-build-gpu}
logs=$out_dir/gpu-logs
mkdir -p "$logs"
jobs=$(nproc)
start=$(date +%s)

step() { echo "== $(date +%T) $*"; }
results=()
record() { results+=("{\"step\":\"$1\",\"status\":\"$2\",\"seconds\":$3}"); }

run_step() { # name, command...: runs it with its output in $logs/name.log
  local name=$1 t0=$(date +%s) rc
  shift
  step "$name: $*"
  "$@" >"$logs/$name.log" 2>&1
  rc=$?
  tail -n 25 "$logs/$name.log"
  record "$name" "$([ $rc -eq 0 ] && echo passed || echo "failed($rc)")" $(($(date +%s) - t0))
  return $rc
}

nvidia-smi -L || { echo "no GPU here"; exit 77; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

run_step configure cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMESHD_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 || { echo "configure failed"; }
run_step build cmake --build "$build" -j"$jobs"
run_step ldd sh -c "ldd $build/bin/meshd-agent | grep -E 'libcudart|libcublas|libnccl'"

# The kernel suite on the GPU, then the compute matrix with agents on GPU 0.
run_step kernels_cuda0 env MESHD_TEST_DEVICE=cuda:0 "$build/bin/test_backend_kernels" --jobs 1
run_step ctest_gpu ctest --test-dir "$build" --output-on-failure -R "cuda_gpu|cuda_comm|cuda_emulated"
# The GPU benchmarks: JSON lines with ratios against baselines of the same run.
run_step bench_gpu "$build/bin/bench_gpu" --device cuda:0 --json "$out_dir/bench-gpu.jsonl"

{
  echo "{"
  echo "  \"gpu\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)\","
  echo "  \"seconds\": $(($(date +%s) - start)),"
  echo "  \"steps\": [$(IFS=,; echo "${results[*]}")],"
  echo -n "  \"bench\": ["
  if [ -s "$out_dir/bench-gpu.jsonl" ]; then paste -sd, "$out_dir/bench-gpu.jsonl"; fi
  echo "]"
  echo "}"
} >"$summary"
cat "$summary"
grep -q failed "$summary" && exit 1
exit 0
