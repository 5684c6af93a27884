#!/usr/bin/env bash
# One call on a 2-GPU machine (kind nvidia-h100-x2; no registry there):
# build in place, then torch's own distributed suite with
# `benchmarks/torch_suite.py --as nccl` (every decision as for NCCL, one rank
# per GPU), run with NCCL itself and then with uccl, back to back.  Each
# backend's tests are cut into SHARDS ranges of test names (default 12), run
# side by side, JOBS at a time (default: all); each range is cut at
# RANGE_TIMEOUT seconds (default: BUDGET=480 s shared among the backends;
# with JOBS below the number of ranges they run in waves, each that long).
#
#   bash benchmarks/device_torch_suite_nccl.sh              # every range, nccl then uccl
#   RANGES="3 4" bash benchmarks/device_torch_suite_nccl.sh # only these ranges (of SHARDS)
#   BACKENDS=uccl bash benchmarks/device_torch_suite_nccl.sh
#
# START=fork starts each test's ranks by fork instead of spawn (quicker; to
# try the script on a machine without GPUs, where every test skips).
#
# Results under $OUT/torch_suite_nccl: per range and backend
# results_<backend>_ws2_shardIIofNN.jsonl (one line per test), tests_*.json
# (the tests the range was given), log_*.txt; torch_suite.md, the merge of
# what this call ran (counts, every test whose outcome differs, the tests of
# NCCL itself).  Tests a range did not reach are "not run": run that range
# again in another call (RANGES=...), then merge every call's folder here:
#   python3 benchmarks/torch_suite.py --as nccl --from DIR1 --from DIR2 --out DIR
set -uo pipefail
source "$(dirname "$0")/device_build.sh"
n=${SHARDS:-12}
backends=${BACKENDS:-nccl uccl}
ranges=${RANGES:-$(seq 1 "$n")}
jobs=${JOBS:-$n}
nb=$(echo $backends | wc -w)
per=${RANGE_TIMEOUT:-$(( ${BUDGET:-480} / nb - 30 ))}   # 30 s: listing the suite, start-up
res="$out/torch_suite_nccl"
mkdir -p "$res"
{ nvidia-smi -L; nvidia-smi topo -m; } > "$res/gpus.txt" 2>&1
echo "ranges [$(echo $ranges)] of $n, $jobs at a time, ${per} s each; backends: $backends"
for b in $backends; do
  t0=$SECONDS
  for i in $ranges; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    timeout $((per + 90)) python3 benchmarks/torch_suite.py --as nccl --backends "$b" \
      --world-sizes 2 --shard "$i/$n" --timeout "$per" --test-timeout "${TEST_TIMEOUT:-60}" \
      --start "${START:-spawn}" --out "$res" > "$res/run_${b}_$i.log" 2>&1 &
  done
  wait
  echo "$b: $((SECONDS - t0)) s"
  grep -h -E "^$b ws=|^torch_suite: (range|note)" "$res"/run_"$b"_*.log
done
merged=uccl,nccl
[ "$nb" = 1 ] && merged=$(echo $backends)   # one backend in this call: its counts only
timeout 120 python3 benchmarks/torch_suite.py --as nccl --backends "$merged" --from "$res" \
  --out "$res" > "$res/merge.log" 2>&1
echo "merge rc=$? (1: a test passes with nccl and not with uccl, or did not run)"
cat "$res/torch_suite.md" 2>/dev/null || tail -30 "$res/merge.log"
