#!/usr/bin/env bash
# Where a small collective's time goes on the GPU machine, in one call:
# build in place; the host cost of each CUDA call the stream-ordered path
# makes (driver_costs.py, without and under CUDA MPS); then under MPS, at 2
# processes, overhead.py's per-call figures (each call synchronised, and
# PIPE calls back to back with one synchronize) with a cProfile of rank 0,
# and the backend's all_reduce / all_gather_into_tensor and the
# CollectiveContext allgather at SIZES, uccl alone.  Results under $OUT (or
# ./bench_out/device): profile.txt (the summary), overhead_profile.txt.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/device_build.sh"
B=benchmarks/benchmark_uccl_collective.py
SIZES=${SIZES:-4,64K,1M,16M}
{
  echo "== driver_costs.py, no MPS"
  timeout -k 5 60 python3 benchmarks/driver_costs.py --iters 5000 2>&1
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/uccl-mps CUDA_MPS_LOG_DIRECTORY=/tmp/uccl-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT && echo "== CUDA MPS on"
  echo "== driver_costs.py, MPS"
  timeout -k 5 60 python3 benchmarks/driver_costs.py --iters 5000 2>&1
  echo "== overhead.py, 2 processes"
  timeout -k 5 150 torchrun --nproc_per_node 2 benchmarks/overhead.py --device gpu --iters 1000 \
    --warmup 100 --rounds 2 --pipelined "${PIPE:-500}" --profile-iters 500 \
    --profile "$out/overhead_profile.txt" 2>&1 | grep -vE "^W[0-9]{4} |^\*+$|OMP_NUM"
  for op in allreduce allgather; do
    echo "== dist $op through uccl, 2 processes, $SIZES"
    timeout -k 5 90 torchrun --nproc_per_node 2 $B --device gpu --backend uccl --op $op \
      --compare none --sizes "$SIZES" --iters 200 --warmup 20 2>&1 | grep -E "^\[Rank 0\]|busbw|Error"
  done
  echo "== CollectiveContext allgather, 2 processes, $SIZES"
  timeout -k 5 90 torchrun --nproc_per_node 2 $B --device gpu --compare none --sizes "$SIZES" \
    --iters 200 --warmup 20 2>&1 | grep -E "^\[Rank 0\]|busbw|Error"
  echo "total $((SECONDS - start))s"
} 2>&1 | tee "$out/profile.txt"
