#!/usr/bin/env bash
# One call on the GPU machine (one H100, no registry there): build in place,
# run tests/test_gpu.py and tests/test_gpu_stream_wait.py, then the GPU p2p benchmarks, each against its
# reference timed in the same run (benchmark_uccl.py --compare auto):
#   gpu->gpu send/recv and --write-ipc, 64K..1G      vs a CUDA IPC copy (ipc-copy)
#   gpu->gpu 64 KiB one-way latency                  vs one IPC copy, host-synchronized
#   cpu->gpu and gpu->cpu, pinned and pageable        vs torch's own copy_ (torch-copy)
#   gpu->gpu over TCP (each rank its own host id)     vs the engine on CPU memory over
#                                                       the same TCP connections (engine-cpu)
# Logs and JSON go to $OUT (or ./bench_out/device): gpu_tests.txt, gpu_<step>.{log,json},
# gpu_summary.txt.  TESTS=0 skips the tests, BENCH=0 the benchmarks.
# Every step runs under `timeout`, capped so that the whole script ends
# within BUDGET_S seconds (default 530: under 9 minutes) whatever hangs.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/device_build.sh"
budget=${BUDGET_S:-530}

# step NAME LIMIT_S CMD...: run CMD (output to $out/gpu_NAME.log) under
# timeout, at most LIMIT_S seconds and never past the budget.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped, ${left}s of the ${budget}s budget left"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout -k 10 "$limit" "$@" > "$out/gpu_$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - start))s elapsed)"
  [ "$rc" = 124 ] && echo "  (timed out after ${limit}s)"
  return 0
}

if [ "${TESTS:-1}" = 1 ]; then
  step tests "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfs -p no:cacheprovider tests/test_gpu.py tests/test_gpu_stream_wait.py
  if [ -f "$out/gpu_tests.log" ]; then
    mv "$out/gpu_tests.log" "$out/gpu_tests.txt"
    tail -5 "$out/gpu_tests.txt"
  fi
fi

if [ "${BENCH:-1}" = 1 ]; then
  bench() {  # bench NAME LIMIT_S benchmark_uccl.py args...
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" torchrun --nproc_per_node 2 benchmarks/benchmark_uccl.py \
      --json "$out/gpu_$name.json" "$@"
    # our figures and the reference's, or the benchmark's own error (once)
    grep -E "^\[Client\]|^  [a-z-]+ .*ratio|benchmark_uccl.py: error|^[A-Za-z]*Error: " \
      "$out/gpu_$name.log" | awk '!seen[$0]++' | head -20
  }
  bench g2g_send 120 --device gpu --sizes 64K,1M,16M,256M,1G --iters 100
  bench g2g_write 120 --device gpu --write-ipc --sizes 64K,1M,16M,256M,1G --iters 100
  bench g2g_latency 90 --device gpu --latency --sizes 64K --iters 1000
  for pin in pinned pageable; do
    flag=$([ "$pin" = pinned ] && echo --pinned || true)
    bench "c2g_$pin" 90 --sender-device cpu --receiver-device gpu $flag --sizes 1M,16M,256M --iters 20
    bench "g2c_$pin" 90 --sender-device gpu --receiver-device cpu $flag --sizes 1M,16M,256M --iters 20
  done
  # GPU memory over TCP (the ranks pretend to be two hosts) against the
  # engine's CPU-memory TCP figure on the same connections, in one run.
  bench g2g_tcp 120 --device gpu --host-id-per-rank --compare engine-cpu --sizes 256M --iters 10

  # One line per size of every run: ours, the reference, the ratio.
  python3 - "$out" > "$out/gpu_summary.txt" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
print(f"{'run':<14} {'size':>7} {'transport':>9}  {'uccl':>10}  {'reference':<11} {'ref':>10}  ratio")
for path in sorted(glob.glob(os.path.join(out, "gpu_*.json"))):
    name = os.path.basename(path)[4:-5]
    for r in json.load(open(path))["results"]:
        lat = "uccl_p50_us" in r
        unit = "us p50" if lat else "GB/s"
        mine = r.get("uccl_p50_us") if lat else r.get("uccl_GBps")
        kind = r.get("ref") or ("gloo" if "ratio" in r else "-")
        key = "ref" if "ref" in r else "gloo"
        ref = r.get(f"{key}_p50_us") if lat else r.get(f"{key}_GBps")
        fmt = lambda v: f"{v:10.2f}" if isinstance(v, (int, float)) else f"{'-':>10}"
        print(f"{name:<14} {r['size_str']:>7} {r['transport']:>9}  {fmt(mine)}  "
              f"{kind:<11} {fmt(ref)}  {r.get('ratio', float('nan')):.2f}x  ({unit})")
EOF
  cat "$out/gpu_summary.txt"
fi
echo "total $((SECONDS - start))s"
