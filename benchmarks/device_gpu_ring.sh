#!/usr/bin/env bash
# One call on the GPU machine: build in place, run tests/test_gpu_ring.py
# (GPU-initiated transfers), then benchmark_gpu_driven.py in loopback and
# in pair mode (two processes sharing the GPU under CUDA MPS unless MPS=0;
# CUDA IPC, then TCP).
# Logs and JSON under $OUT (or ./bench_out/device): ring_tests.txt,
# ring_<mode>.{log,json}.  TESTS=0 / BENCH=0 skip a part; every step runs
# under `timeout`, and the script ends within BUDGET_S (default 500) seconds.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/device_build.sh"
budget=${BUDGET_S:-500}
{ python3 -c "import uccl_collective.gpu_ring as g; print('nvrtc:', g.find_nvrtc())"; } >> "$out/machine.txt" 2>&1

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then echo "$name: skipped, ${left}s left"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout -k 10 "$limit" "$@" > "$out/ring_$name.log" 2>&1
  echo "$name: rc=$? ($((SECONDS - start))s elapsed)"
  tail -${TAIL:-12} "$out/ring_$name.log"
}

if [ "${TESTS:-1}" = 1 ]; then
  step tests "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfs -p no:cacheprovider ${RING_TESTS:-tests/test_gpu_ring.py}
fi
if [ "${BENCH:-1}" = 1 ]; then
  step loopback 120 python3 benchmarks/benchmark_gpu_driven.py --mode loopback --json "$out/ring_loopback.json"
  # Two processes on one GPU time-slice it: a kernel still running (its
  # threads waiting for free slots) holds the GPU for a whole time slice
  # (~1.8 ms measured) before the peer's copy of each command can run.  CUDA
  # MPS runs both processes' work at once; pair runs with it where it starts.
  if [ "${MPS:-1}" = 1 ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/uccl-mps CUDA_MPS_LOG_DIRECTORY=/tmp/uccl-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      trap 'echo quit | nvidia-cuda-mps-control' EXIT
      echo "CUDA MPS on"
    else
      echo "CUDA MPS could not start: pair runs time-slice the GPU"
    fi
  fi
  step pair_ipc 150 python3 benchmarks/benchmark_gpu_driven.py --mode pair ${PAIR_ARGS:-} --json "$out/ring_pair_ipc.json"
  UCCL_P2P_TRANSPORT=tcp step pair_tcp 120 python3 benchmarks/benchmark_gpu_driven.py --mode pair \
    --sizes 4096,65536,1048576 --commands 1024 --iters 3 --json "$out/ring_pair_tcp.json"
fi
