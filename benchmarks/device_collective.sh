#!/usr/bin/env bash
# One call on the GPU machine (no registry there): build in place, run the
# test suite, then the CPU allgather benchmark at 2, 4 and 8 ranks against
# Gloo (direct and ring).  Logs go to $OUT (or ./bench_out/device).
set -uo pipefail
source "$(dirname "$0")/device_build.sh"
timeout 400 python3 -m pytest -q -p no:cacheprovider tests > "$out/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$out/tests.log"
for n in 2 4; do
  for algo in direct ring; do
    timeout 150 torchrun --nproc_per_node $n benchmarks/benchmark_uccl_collective.py --sizes ${SIZES:-1M,4M,16M,64M} \
      --algorithm $algo --iters 10 --compare gloo --json "$out/ag_${algo}_n$n.json" > "$out/ag_${algo}_n$n.log" 2>&1
    echo "n=$n $algo rc=$?"; grep -E "Rank 0\]|gloo busbw" "$out/ag_${algo}_n$n.log"
  done
done
timeout 120 torchrun --nproc_per_node 8 benchmarks/benchmark_uccl_collective.py --sizes 1M,16M --iters 5 \
  --compare gloo --json "$out/ag_auto_n8.json" > "$out/ag_auto_n8.log" 2>&1
echo "n=8 rc=$?"; grep -E "Rank 0\]|gloo busbw" "$out/ag_auto_n8.log"
