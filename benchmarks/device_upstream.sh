#!/usr/bin/env bash
# One call on the GPU machine: build in place, run this package's tests of
# the drop-in on GPU memory (test_gpu.py -k "upstream or bus_id": the IPC
# forms, register_memory/transfer, a GPU named by PCI bus id), then upstream
# UCCL's own p2p tests and benchmarks against this package
# (benchmarks/run_upstream.py) from the folders UPSTREAM_SRC names
# (space-separated; upstream's files are never committed: carry them, e.g.
# run's carry=["_upstream"]).
# Output in $OUT (or ./bench_out/device): upstream_<n>.{md,json,log},
# gpu_upstream_tests.txt.  Bounded by BUDGET_S seconds (default 540).
#
# GPUS=2 or GPUS=4: instead, only the entries that need one GPU per rank
# (run_upstream.py --multi-gpu --ranks $GPUS: benchmark_uccl_collective in
# each mode, the allgather and alltoall benchmarks, test_engine_nvlink) and
# upstream's NCCL baselines, from UPSTREAM_SRC (default _upstream/old, the
# last upstream version with the collective benchmarks; carry it).  Output
# upstream_gpus<N>_<folder>.{md,json,log}, with the ours-vs-NCCL table.  The
# machine must have that many GPUs (run's kind nvidia-h100-x2 / -x4).
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/device_build.sh"
budget=${BUDGET_S:-540}
left() { echo $((budget - (SECONDS - start))); }

if [ -n "${GPUS:-}" ]; then
  case "$GPUS" in 2|4) ;; *) echo "GPUS must be 2 or 4"; exit 2 ;; esac
  nvidia-smi -L 2>&1 | head -8
  for src in ${UPSTREAM_SRC:-_upstream/old}; do
    lim=$(left)
    [ "$lim" -lt 60 ] && { echo "upstream $src: skipped, budget spent"; continue; }
    tag=gpus$GPUS${src//[^A-Za-z0-9]/_}
    echo "== $GPUS ranks, upstream files from $src"
    timeout -k 10 "$lim" python3 benchmarks/run_upstream.py --src "$src" --multi-gpu \
      --ranks "$GPUS" --nvtx-stub --timeout ${FILE_TIMEOUT:-45} \
      --markdown "$out/upstream_$tag.md" --json "$out/upstream_$tag.json" > "$out/upstream_$tag.log" 2>&1
    echo "rc=$? ($((SECONDS - start))s)"
    cat "$out/upstream_$tag.log"
  done
  exit 0
fi

lim=$(left); [ "$lim" -gt 240 ] && lim=240
timeout -k 10 "$lim" python3 -m pytest -q -rfs -p no:cacheprovider tests/test_gpu.py \
  -k "upstream or bus_id" > "$out/gpu_upstream_tests.txt" 2>&1
echo "gpu tests: rc=$? ($((SECONDS - start))s)"
tail -5 "$out/gpu_upstream_tests.txt"

n=0
for src in ${UPSTREAM_SRC:-_upstream/head _upstream/old}; do
  n=$((n + 1))
  lim=$(left); [ "$lim" -gt 300 ] && lim=300
  [ "$lim" -lt 30 ] && { echo "upstream $src: skipped, budget spent"; continue; }
  echo "== upstream files from $src"
  timeout -k 10 "$lim" python3 benchmarks/run_upstream.py --src "$src" --timeout ${FILE_TIMEOUT:-60} \
    --markdown "$out/upstream_$n.md" --json "$out/upstream_$n.json" > "$out/upstream_$n.log" 2>&1
  echo "rc=$? ($((SECONDS - start))s)"
  cat "$out/upstream_$n.log"
done

