#!/usr/bin/env bash
# One call on the GPU machine (no registry there): build in place, run the
# process-group tests, then dist.all_reduce and dist.all_gather_into_tensor
# through the "uccl" group against Gloo at 2 and 4 ranks, 1 MiB to 256 MiB.
# Logs go to $OUT (or ./bench_out/device).  TESTS=0 skips the tests.
set -uo pipefail
source "$(dirname "$0")/device_build.sh"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider ${TEST_FILES:-tests/test_backend.py tests/test_backend_fsdp.py tests/test_backend_review.py} > "$out/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$out/tests.log"
fi
for n in ${WORLDS:-2 4}; do
  for op in ${OPS:-allreduce allgather}; do
    timeout 200 torchrun --nproc_per_node $n benchmarks/benchmark_uccl_collective.py --backend uccl \
      --op $op --sizes ${SIZES:-1M,4M,16M,64M,256M} --iters ${ITERS:-5} --json "$out/pg_${op}_n$n.json" \
      > "$out/pg_${op}_n$n.log" 2>&1
    echo "n=$n $op rc=$?"; grep -E "Rank 0\]|gloo busbw" "$out/pg_${op}_n$n.log"
  done
done
