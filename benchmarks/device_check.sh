#!/usr/bin/env bash
# The whole GPU check of a tree in one call on the GPU machine (one H100,
# under 10 minutes): build in place, start CUDA MPS (2-4 processes share the
# GPU), run every GPU test file, then the GPU-initiated transfer benchmarks
# against host-initiated transfers (benchmark_gpu_driven.py, through
# device_gpu_ring.sh).  Results under $OUT (or ./bench_out/device):
# check_tests.txt, ring_<mode>.{log,json}; with COLL, coll_summary.txt and
# coll/ (device_gpu_collective.sh's runs against Gloo).
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/device_build.sh"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/uccl-mps CUDA_MPS_LOG_DIRECTORY=/tmp/uccl-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if nvidia-cuda-mps-control -d; then
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  echo "CUDA MPS on"
fi
timeout -k 10 "${TEST_TIMEOUT:-400}" python3 -m pytest -q -rfs -p no:cacheprovider \
  tests/test_gpu.py tests/test_gpu_stream_wait.py tests/test_gpu_collective.py \
  tests/test_gpu_ring.py > "$out/check_tests.txt" 2>&1
echo "tests: rc=$? ($((SECONDS - start))s)"
tail -4 "$out/check_tests.txt"
grep -E "^FAILED|^ERROR" "$out/check_tests.txt" | head -20
# the daemon is up and its variables exported: the scripts below must not start another.
# RING=0 skips the GPU-initiated transfer benchmarks; COLL="pg_allreduce ..." runs
# those runs of device_gpu_collective.sh (its BENCHES) at COLL_NPROCS (default 2).
if [ "${RING:-1}" = 1 ]; then
  TESTS=0 MPS=0 BUDGET_S=$((570 - (SECONDS - start))) bash "$(dirname "$0")/device_gpu_ring.sh"
fi
if [ -n "${COLL:-}" ]; then
  TESTS=0 MPS=0 BENCHES="$COLL" NPROCS="${COLL_NPROCS:-2}" BUDGET_S=$((570 - (SECONDS - start))) \
    bash "$(dirname "$0")/device_gpu_collective.sh"
fi
