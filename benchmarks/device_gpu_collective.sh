#!/usr/bin/env bash
# One call on the GPU machine (one H100, no registry there; 2 or 4 processes
# share the GPU): build in place, run tests/test_gpu_collective.py, then the
# collectives on CUDA tensors, each against its reference timed in the same run:
#   CollectiveContext allgather, 64K..256M per rank    vs the raw CUDA IPC copies (ipc-copy;
#                                                         target: time <= 1.25x at >= 16 MiB)
#   CollectiveContext allgather, 1M..64M               vs Gloo's list all_gather on CUDA tensors
#   dist.all_gather_into_tensor / dist.all_reduce on
#   the "uccl" group, 1M..256M                         vs Gloo on the same CUDA tensors
#   a ring step of dist.batch_isend_irecv (point to point), 4 B..16M
#                                                      vs Gloo (host-staged) and ipc-copy
#   each at 2 and 4 processes (2 first);
#   the 64 KiB CollectiveContext allgather at 2 processes, 1000 calls (target: <= 40 us);
#   benchmarks/overhead.py --device gpu (4-byte allgather / all_reduce per call, with a profile).
# NCCL is no reference here: its communicator hangs on one shared GPU.
# Logs and JSON go to $OUT (or ./bench_out/device)/coll/, the table to
# $out/coll_summary.txt.  TESTS=0 skips the tests, BENCH=0 the benchmarks;
# PACK=1 packs coll/ into $out/coll_logs.tgz and removes the folder (for the
# device tool, which brings back at most 8 files).  Every step runs under
# `timeout`, capped so that the whole script ends within BUDGET_S seconds
# (default 530: under 9 minutes) whatever hangs.  TEST_FILES: the test files
# (default tests/test_gpu_collective.py), one step each; NPROCS: the process
# counts (default "2 4"); BENCHES: only these benchmark runs (ag_ipc,
# ag_ipc_own, ag_ipc_inplace, ag_64k, ag_gloo, pg_allgather, pg_allreduce, pg_ring,
# pg_ring_ipc, overhead, floor).  Everything runs under
# CUDA MPS (the daemon is started here and stopped at the end; MPS=0 runs
# without): processes sharing one GPU then run their work side by side
# instead of time-slicing the GPU.  Without MPS, a copy waited for on the
# host costs ~275 us when 2 processes do it at once and ~550 us with 4
# (benchmarks/gpu_share_floor.py; docs/benchmark-log.md), whatever moves it: that
# is the shared GPU, not the library, and it hides everything else.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/device_build.sh"
budget=${BUDGET_S:-530}
logs=$out/coll
mkdir -p "$logs"
echo "build done ($((SECONDS - start))s elapsed); logs in $logs"
if [ "${MPS:-1}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/uccl-mps CUDA_MPS_LOG_DIRECTORY=/tmp/uccl-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS=1: cannot start nvidia-cuda-mps-control"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  echo "CUDA MPS on"
fi

# step NAME LIMIT_S CMD...: run CMD (output to $logs/NAME.log) under
# timeout, at most LIMIT_S seconds and never past the budget.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 25 ]; then
    echo "$name: skipped, ${left}s of the ${budget}s budget left"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout -k 10 "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - start))s elapsed)"
  [ "$rc" = 124 ] && echo "  (timed out after ${limit}s)"
  return 0
}

if [ "${TESTS:-1}" = 1 ]; then
  for f in ${TEST_FILES:-tests/test_gpu_collective.py}; do   # one step (and log) per file
    name=tests_$(basename "$f" .py)
    step "$name" "${TEST_TIMEOUT:-180}" python3 -m pytest -q -rfs -p no:cacheprovider "$f"
    tail -3 "$logs/$name.log" 2>/dev/null
  done
fi

if [ "${BENCH:-1}" = 1 ]; then
  B=benchmarks/benchmark_uccl_collective.py
  bench() {  # bench NAME NPROC LIMIT_S benchmark_uccl_collective.py args...
    local name=$1 n=$2 limit=$3
    shift 3
    case " ${BENCHES:-$name} " in *" $name "*) ;; *) return 0 ;; esac   # BENCHES: run only these
    step "${name}_n$n" "$limit" torchrun --nproc_per_node "$n" $B --device gpu --timeout 60 \
      --json "$logs/${name}_n$n.json" "$@"
    # our figures and the reference's, or the benchmark's own error (once)
    grep -E "^\[Rank 0\]|^ +[a-z-]+ busbw|benchmark_uccl_collective.py: error|^\[Rank [0-9]+\] .*(wrong|differs)|^[A-Za-z]*Error: " \
      "$logs/${name}_n$n.log" 2>/dev/null | awk '!seen[$0]++' | head -20
  }
  for n in ${NPROCS:-2 4}; do
    bench ag_ipc "$n" 100 --compare ipc-copy --sizes 64K,1M,16M,64M,256M
    # the same against the copies an out-of-place allgather makes (its own chunk too)
    bench ag_ipc_own "$n" 60 --compare ipc-copy --ipc-own-copy --sizes 16M,64M,256M
    # in place (the send tensor is this rank's chunk of the output): only the
    # N(N-1) cross-process chunks move, exactly ipc-copy's copies; 200 calls
    # a size (20 carry the first calls' cost: 1.92x against 1.42x at 16 MiB,
    # 2 ranks, docs/benchmark-log.md session 12)
    bench ag_ipc_inplace "$n" 90 --compare ipc-copy --in-place --sizes 16M,64M,256M --iters 200
    if [ "$n" = 2 ]; then
      # the 64 KiB allgather's time per call, many calls (target <= 40 us)
      bench ag_64k 2 60 --compare ipc-copy --sizes 64K --iters 1000 --warmup 50
    fi
    bench ag_gloo "$n" 90 --compare gloo --sizes 1M,16M,64M --iters 5 --warmup 1
    bench pg_allgather "$n" 100 --backend uccl --op allgather --compare gloo \
      --sizes 1M,16M,64M,256M
    bench pg_allreduce "$n" 100 --backend uccl --op allreduce --compare gloo \
      --sizes 1M,16M,64M,256M
    # point to point per message: a ring step of batch_isend_irecv, each Work waited for
    bench pg_ring "$n" 100 --backend uccl --op ring --compare gloo --sizes 4,64K,1M,16M \
      --iters 200 --warmup 20
    bench pg_ring_ipc "$n" 60 --backend uccl --op ring --compare ipc-copy --sizes 4,64K,1M,16M \
      --iters 200 --warmup 20
    if [ "$n" = 2 ] && [[ " ${BENCHES:-overhead} " == *" overhead "* ]]; then
      step overhead_n2 90 torchrun --nproc_per_node 2 benchmarks/overhead.py --device gpu \
        --iters 2000 --pipelined 1000 --profile "$logs/overhead_profile.txt" \
        --json "$logs/overhead_n2.json"
      grep -vE "^W[0-9]{4} " "$logs/overhead_n2.log" | head -30
    fi
    if [ "$n" = 2 ] && [[ " ${BENCHES:-floor} " == *" floor "* ]]; then
      # what a backend that does nothing costs per dist.* call: the floor of any Python backend
      step floor_n2 90 torchrun --nproc_per_node 2 benchmarks/pg_floor.py --device gpu \
        --iters 2000 --rounds 5
      grep -E "^\[Rank 0\]|^ +[0-9]+ B " "$logs/floor_n2.log" | head -12
    fi
  done

  # One line per size of every run: ours, the reference, the ratios, the target.
  python3 - "$logs" > "$out/coll_summary.txt" <<'EOF'
import glob, json, os, sys
logs = sys.argv[1]
fmt = lambda v, w=9, p=1: f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"
print(f"{'run':<16} {'n':>2} {'size':>7}  {'uccl us':>9} {'busbw':>8}  {'reference':<22} "
      f"{'ref us':>9} {'busbw':>8}  {'uccl/ref':>8}  target")
order = ["ag_ipc", "ag_ipc_own", "ag_ipc_inplace", "ag_64k", "ag_gloo", "pg_allgather",
         "pg_allreduce", "pg_ring", "pg_ring_ipc"]
runs = []
for path in glob.glob(os.path.join(logs, "*.json")):
    run, n = os.path.basename(path)[:-5].rsplit("_n", 1)
    if run in order:
        runs.append((order.index(run), int(n), run, path))
for _, n, run, path in sorted(runs):
    for r in json.load(open(path))["results"]:
        target = ""
        if "target_met" in r:
            target = f"<= {r['target_time_ratio']:.2f}x: {'met' if r['target_met'] else 'missed'}"
        if run == "ag_64k":
            target = f"<= 40 us: {'met' if r['uccl_us'] <= 40 else 'missed'}"
        tr = r.get("time_ratio")
        print(f"{run:<16} {n:>2} {r['size_str']:>7}  {fmt(r['uccl_us'])} "
              f"{fmt(r['uccl_busbw_GBps'], 8, 2)}  {r.get('ref', '-'):<22} {fmt(r.get('ref_us'))} "
              f"{fmt(r.get('ref_busbw_GBps'), 8, 2)}  {fmt(tr, 7, 2)}{'x' if tr else ' '}  {target}")
print("(us: per call, slowest rank; busbw: GB/s, nccl-tests convention; uccl/ref: time ratio, "
      "below 1 = uccl faster)")
for path in sorted(glob.glob(os.path.join(logs, "overhead_n*.json"))):
    d = json.load(open(path))
    print(f"\noverhead.py, {d['world']} ranks, 4 B per rank, per call (slowest rank):")
    print(f"{'device':<6} {'path':<34} {'p50 us':>9} {'mean us':>9}  uccl/gloo (p50)")
    for r in d["results"]:
        ratio = f"{r['x_gloo_p50']:.2f}x" if "x_gloo_p50" in r else "-"
        print(f"{r['device']:<6} {r['path']:<34} {fmt(r['p50_us'])} {fmt(r['mean_us'])}  {ratio}")
    if d.get("idle_sync_us") is not None:
        print(f"(cuda rows include a stream synchronize: {d['idle_sync_us']:.1f} us on an idle stream)")
EOF
  cat "$out/coll_summary.txt"
  if [ -f "$logs/overhead_profile.txt" ]; then
    echo "--- overhead profile (head) ---"
    grep -E "^=====|cumtime|_engine|collective.py|process_group.py|dispatch.py|_work.py" "$logs/overhead_profile.txt" | head -40
  fi
fi
if [ "${PACK:-0}" = 1 ]; then
  tar czf "$out/coll_logs.tgz" -C "$out" coll && rm -rf "$logs" && echo "logs packed into $out/coll_logs.tgz"
fi
echo "total $((SECONDS - start))s"
