#!/usr/bin/env bash
# The multi-GPU checks of a tree, a part a call, on one 4-GPU machine
# (kind nvidia-h100-x4), back to back so the machine stays warm and the
# build is made once.  Each part fits one call (BUDGET_S, default 570 s),
# runs the scripts below with their outputs under /tmp/campaign, and packs
# them into $OUT/part<N>.tgz (a call brings back 8 files at most).
#
#   PART=1  every GPU to itself (fault trials look at every GPU's memory and
#           at /dev/shm, so nothing else may run beside them):
#           ipc_close_probe.py (exporter on GPU 1 and on GPU 0), the GPU
#           ring's SIGKILL trials at 4 and 2 GPUs, tests/test_gpu_faults.py,
#           upstream's one-GPU-per-rank scripts at 4 ranks.
#   PART=2  torch's suite gated as NCCL (device_torch_suite_nccl.sh): NCCL
#           on GPUs 0,1 and uccl on GPUs 2,3 at the same time, then merged.
#   PART=3  the GPU test files (device_check.sh, RING=0, CUDA MPS) on GPUs
#           0,1; beside them on GPUs 2,3 upstream's scripts at 2 ranks.
#   PART=4  a check of fixes in one call: the probe, the GPU ring's SIGKILL
#           trials at 4 GPUs (RING_TRIALS, default 20), then on GPUs 0,1
#           the suite's tests named in SUITE_TESTS with uccl (--as nccl, in
#           SUITE_SHARDS ranges side by side) and on GPUs 2,3
#           tests/test_upstream_gpu.py at 2 ranks.
#   PART=5  the 4-GPU ring's warm-up timeout: the probe, then trial ONLY
#           (default 2) of the ring's SIGKILL campaign alone, with the
#           engine's INFO log and its threads' stacks (thread_stacks.sh).
#   PART=6  a tree's GPU checks: the SIGKILL trials at 4 GPUs of FAULT_OPS
#           (default the GPU ring; RING_TRIALS, default 20), then the GPU
#           test files in two lanes (GPUs 0,1 and 2,3) under one CUDA MPS
#           daemon, then test_gpu_collective.py's cases with a GPU per rank
#           on every GPU (SPREAD_S kept for them, default 150 s); PROBES=1
#           runs stream_queue_probe.py (8 and 32 hardware queues) first.
#   PART=7  the ring's SIGKILL trials at 4 GPUs with CUDA_MODULE_LOADING=EAGER
#           and the harness's kernel preload off, then with torch's LAZY
#           default and the preload.
#   PART=8  the race against NCCL: gpu_copy_ceiling.py (push, pull, SM) at 4 and
#           2 GPUs, then every op of benchmark_uccl_collective.py against
#           NCCL at 4 and 2 ranks (OPS, SIZES to narrow it; CTX=0 leaves out
#           CollectiveContext.allgather).
#   PART=9  the race in one call: test_gpu_collective.py's multi-GPU cases (a
#           GPU per rank, 8 ranks two a GPU under MPS, two "nodes"), then
#           benchmark_uccl_collective.py --op all against NCCL at 4 and 2
#           ranks (SIZES, ROUNDS): a table, CSV, JSON and PNG each.
#           TESTS_K narrows the tests (a pytest -k expression), RACE_WORLDS
#           the rank counts raced ("" for none).
#   PART=10 CUDA graphs: tests/test_gpu_graph.py (collectives captured and
#           replayed with a GPU per rank), test_compile.py on CUDA, then
#           graph_decode.py (a decode step captured, uccl against NCCL) at
#           2 ranks and, where there are 4 GPUs, 4.
#   PART=11 the captured decode step's sweep: graph_decode.py at 2 ranks
#           with the LL lines (UCCL_SG_GRAPH_LL_BYTES default) and without
#           (0), then at 4 ranks; a rank still running near its step's end
#           prints its Python stacks (SIGSEGV under PYTHONFAULTHANDLER).
#
# Run from the repository root with _upstream/old carried (device_upstream.sh).
set -uo pipefail
start=$SECONDS
budget=${BUDGET_S:-570}
here=$(dirname "$0")
dest=${OUT:-bench_out/device}
res=/tmp/campaign/part${PART:?PART=1 to 11}
mkdir -p "$res" "$dest"
OUT=$res
source "$here/device_build.sh"
export UCCL_BUILT=1          # the scripts below skip the build made here
left() { echo $((budget - 25 - (SECONDS - start))); }   # 25 s: packing and the way back
step() {  # step NAME SECONDS COMMAND...: run, cut at SECONDS (and at the budget), log it
  local name=$1 lim=$2; shift 2
  [ "$(left)" -lt "$lim" ] && lim=$(left)
  [ "$lim" -lt 20 ] && { echo "$name: skipped, budget spent" | tee -a "$res/summary.txt"; return; }
  timeout -k 10 "$lim" "$@" > "$res/$name.log" 2>&1
  echo "$name: rc=$? at $((SECONDS - start)) s" | tee -a "$res/summary.txt"
}

case "$PART" in
1)
  step probe_1_0 60 python3 "$here/ipc_close_probe.py" --devices 1,0 --spin-ms 3000 --json "$res/probe_1_0.json"
  step probe_0_0 60 python3 "$here/ipc_close_probe.py" --devices 0,0 --spin-ms 3000 --json "$res/probe_0_0.json"
  for w in 4 2; do
    step "ring_faults_w$w" 150 python3 "$here/gpu_fault_trials.py" --world "$w" --ops gpu_ring \
      --trials 10 --json "$res/ring_faults_w$w.json"
  done
  step gpu_faults_tests 200 python3 -m pytest -q -rfs -p no:cacheprovider tests/test_gpu_faults.py
  step upstream_4 170 env OUT="$res" GPUS=4 BUDGET_S=160 bash "$here/device_upstream.sh"
  ;;
2)
  lim=$(( $(left) - 10 ))
  for lane in "0,1 nccl" "2,3 uccl"; do
    set -- $lane
    CUDA_VISIBLE_DEVICES=$1 OUT="$res/$2" BACKENDS=$2 BUDGET=$((lim - 40)) \
      timeout -k 10 "$lim" bash "$here/device_torch_suite_nccl.sh" > "$res/suite_$2.log" 2>&1 &
  done
  wait
  echo "suites done at $((SECONDS - start)) s" >> "$res/summary.txt"
  timeout 60 python3 "$here/torch_suite.py" --as nccl --backends uccl,nccl \
    --from "$res/nccl/torch_suite_nccl" --from "$res/uccl/torch_suite_nccl" --out "$res" \
    > "$res/merge.log" 2>&1
  echo "merge: rc=$?" >> "$res/summary.txt"
  ;;
3)
  lim=$(left)
  (CUDA_VISIBLE_DEVICES=0,1 OUT="$res/check" RING=0 TEST_TIMEOUT=$((lim - 30)) \
     timeout -k 10 "$lim" bash "$here/device_check.sh" > "$res/check.log" 2>&1) &
  (export CUDA_VISIBLE_DEVICES=2,3
   step upstream_2 240 env OUT="$res" GPUS=2 BUDGET_S=230 bash "$here/device_upstream.sh"
   step alltoall_2 120 torchrun --nproc_per_node 2 "$here/benchmark_uccl_collective.py" \
     --backend uccl --op alltoall --device gpu --sizes 8,64K,1M,16M,256M --compare nccl \
     --json "$res/alltoall_2.json") &
  wait
  echo "check: $(tail -3 "$res/check/check_tests.txt" 2>/dev/null | tr '\n' ' ')" >> "$res/summary.txt"
  ;;
4)
  step probe_1_0 60 python3 "$here/ipc_close_probe.py" --devices 1,0 --spin-ms 3000 --json "$res/probe_1_0.json"
  step probe_0_0 60 python3 "$here/ipc_close_probe.py" --devices 0,0 --spin-ms 3000 --json "$res/probe_0_0.json"
  step ring_faults_w4 "${RING_CAP:-130}" python3 "$here/gpu_fault_trials.py" --world 4 --ops gpu_ring \
    --trials "${RING_TRIALS:-20}" --json "$res/ring_faults_w4.json"
  lim=$(left)
  ns=${SUITE_SHARDS:-6}
  for i in $(seq 1 "$ns"); do
    CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 "$lim" python3 "$here/torch_suite.py" --as nccl \
      --backends uccl --world-sizes 2 --tests "${SUITE_TESTS:?name the suite tests}" \
      --shard "$i/$ns" --timeout $((lim - 20)) --test-timeout 60 --out "$res/suite" \
      > "$res/suite_$i.log" 2>&1 &
  done
  (export CUDA_VISIBLE_DEVICES=2,3
   step upstream_test "$lim" python3 -m pytest -q -rs -p no:cacheprovider \
     "tests/test_upstream_gpu.py::test_upstream_gpu_scripts_pass_unchanged[2]") &
  wait
  timeout 60 python3 "$here/torch_suite.py" --as nccl --backends uccl --from "$res/suite" \
    --out "$res" > "$res/merge.log" 2>&1
  { echo "suite merge: rc=$?"; grep -A4 "^| backend" "$res/torch_suite.md"; } >> "$res/summary.txt" 2>&1
  tail -3 "$res/upstream_test.log" >> "$res/summary.txt"
  ;;
5)
  # the 4-GPU ring's warm-up timeout, looked at: the probe, then the trial
  # that fails, alone, with the engine's INFO log and its threads' stacks
  step probe_1_0 60 python3 "$here/ipc_close_probe.py" --devices 1,0 --spin-ms 3000 --json "$res/probe_1_0.json"
  step probe_0_0 60 python3 "$here/ipc_close_probe.py" --devices 0,0 --spin-ms 3000 --json "$res/probe_0_0.json"
  UCCL_P2P_LOG_LEVEL=INFO timeout -k 10 120 python3 "$here/gpu_fault_trials.py" --world 4 \
    --ops gpu_ring --trials 10 --only "${ONLY:-2}" --json "$res/ring_only.json" > "$res/ring_only.log" 2>&1 &
  pid=$!
  bash "$here/thread_stacks.sh" "$pid" 110 1 > "$res/stacks.txt" 2>&1
  wait "$pid"
  echo "ring_only ${ONLY:-2}: rc=$? at $((SECONDS - start)) s" >> "$res/summary.txt"
  grep -E "trials passed|^\| gpu_ring" "$res/ring_only.log" >> "$res/summary.txt"
  grep -c "WARNING" "$res/ring_only.log" >> "$res/summary.txt"
  ;;
6)
  # a tree's GPU checks: the SIGKILL trials at 4 GPUs alone, then the GPU
  # test files in two lanes (GPUs 0,1 and 2,3) under one CUDA MPS daemon,
  # then the backend's cases with a GPU per rank (every GPU; 8 ranks two a GPU)
  if [ "${PROBES:-0}" = 1 ]; then
    step streams_8 40 python3 "$here/stream_queue_probe.py" --json "$res/streams_8.json"
    step streams_32 40 env CUDA_DEVICE_MAX_CONNECTIONS=32 python3 "$here/stream_queue_probe.py" \
      --json "$res/streams_32.json"
    step streams_wait 40 python3 "$here/stream_queue_probe.py" --blocker wait-value \
      --json "$res/streams_wait.json"
    grep "waited for the held stream:" "$res"/streams_*.log >> "$res/summary.txt"
  fi
  step ring_faults_w4 "${RING_CAP:-200}" python3 "$here/gpu_fault_trials.py" --world 4 \
    --ops "${FAULT_OPS:-gpu_ring}" --trials "${RING_TRIALS:-20}" --json "$res/ring_faults_w4.json"
  grep -E "trials passed|FAIL" "$res/ring_faults_w4.log" | cut -c1-400 >> "$res/summary.txt"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/uccl-mps CUDA_MPS_LOG_DIRECTORY=/tmp/uccl-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
  lim=$(( $(left) - ${SPREAD_S:-150} ))
  CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 "$lim" python3 -m pytest -q -rfs -p no:cacheprovider \
    tests/test_gpu.py tests/test_gpu_stream_wait.py tests/test_gpu_ring.py > "$res/check_a.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=2,3 timeout -k 10 "$lim" python3 -m pytest -q -rfs -p no:cacheprovider \
    tests/test_gpu_collective.py -k "not gpu_per_rank" > "$res/check_b.txt" 2>&1 &
  wait
  step check_spread "$(left)" env UCCL_GPU_TESTS_MPS=1 python3 -m pytest -q -rfs -p no:cacheprovider \
    tests/test_gpu_collective.py -k gpu_per_rank
  mv "$res/check_spread.log" "$res/check_spread.txt"
  for f in check_a check_b check_spread; do
    echo "$f: $(tail -1 "$res/$f.txt")" >> "$res/summary.txt"
    grep -E "^FAILED|^ERROR" "$res/$f.txt" | head -20 >> "$res/summary.txt"
  done
  ;;
7)
  # the ring's warm-up timeout against CUDA lazy loading: the trials with
  # every module loaded at start (EAGER) and the harness's preload off, then
  # torch's default (LAZY) with the harness's preload
  for run in "eager env CUDA_MODULE_LOADING=EAGER UCCL_FAULTS_NO_PRELOAD=1" "lazy_preload env"; do
    set -- $run
    name=$1; shift
    step "ring_$name" "${RING_CAP:-200}" "$@" python3 "$here/gpu_fault_trials.py" --world 4 \
      --ops gpu_ring --trials "${RING_TRIALS:-20}" --json "$res/ring_$name.json"
    grep -E "trials passed|FAIL" "$res/ring_$name.log" | cut -c1-300 >> "$res/summary.txt"
  done
  ;;
8)
  # the race against NCCL: the copy ceiling (push, pull, SM) at 4 and 2 GPUs, then
  # every op against NCCL in the same run, at 4 and then 2 ranks
  export NCCL_NVLS_ENABLE=0
  for g in 0,1,2,3 0,1; do
    step "ceiling_${g//,/}" 90 python3 "$here/gpu_copy_ceiling.py" --gpus "$g" --size 256M \
      --json "$res/ceiling_${g//,/}.json"
  done
  grep -h "busbw" "$res"/ceiling_*.log >> "$res/summary.txt"
  for w in 4 2; do
    for op in ${OPS:-allreduce allgather reduce_scatter broadcast alltoall ring}; do
      step "${op}_$w" 100 torchrun --nproc_per_node "$w" "$here/benchmark_uccl_collective.py" \
        --backend uccl --op "$op" --device gpu --compare nccl --sizes "${SIZES:-8,64K,1M,16M,256M}" \
        --json "$res/${op}_$w.json"
    done
    [ "${CTX:-1}" = 1 ] && step "ctx_allgather_$w" 100 torchrun --nproc_per_node "$w" "$here/benchmark_uccl_collective.py" \
      --backend context --op allgather --device gpu --compare nccl --sizes "${SIZES:-8,64K,1M,16M,256M}" \
      --json "$res/ctx_allgather_$w.json"
  done
  ;;
9)
  # the race against NCCL in one call: the multi-GPU tests (a GPU per rank:
  # 2, 3, 4 ranks, 8 under MPS; two "nodes" of two), then every op at 4
  # and 2 ranks against NCCL in one run each (--op all): a Markdown table,
  # CSV, JSON and a PNG (where matplotlib is there) per GPU count
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/uccl-mps CUDA_MPS_LOG_DIRECTORY=/tmp/uccl-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
  step tests "${TESTS_S:-200}" env UCCL_GPU_TESTS_MPS=1 python3 -m pytest -q -rfs \
    -p no:cacheprovider tests/test_gpu_collective.py -k "${TESTS_K:-gpu_per_rank or two_nodes}"
  echo quit | nvidia-cuda-mps-control
  { tail -1 "$res/tests.log"; grep -E "^FAILED|^ERROR" "$res/tests.log" | head -20; } \
    >> "$res/summary.txt"
  export NCCL_NVLS_ENABLE=0
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
  for w in ${RACE_WORLDS-4 2}; do
    [ "$ngpu" -ge "$w" ] || continue
    step "race_$w" $(( ($(left) - 20) / (w == 4 ? 2 : 1) )) torchrun --nproc_per_node "$w" \
      "$here/benchmark_uccl_collective.py" --backend uccl --op all --device gpu --compare nccl \
      --sizes "${SIZES:-8,64K,1M,16M,256M}" --rounds "${ROUNDS:-3}" --table "$res/race_$w.md" \
      --csv "$res/race_$w.csv" --json "$res/race_$w.json" --plot "$res/race_$w.png"
    cat "$res/race_$w.md" >> "$res/summary.txt" 2>/dev/null
  done
  ;;
10)
  export NCCL_NVLS_ENABLE=0
  step graph_tests 300 python3 -m pytest -q -rfs -p no:cacheprovider tests/test_gpu_graph.py \
    tests/test_compile.py -k "graph or cuda"
  tail -3 "$res/graph_tests.log" >> "$res/summary.txt"
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
  for w in 2 4; do
    [ "$ngpu" -ge "$w" ] || continue
    step "decode_$w" 120 torchrun --nproc_per_node "$w" "$here/graph_decode.py" \
      --json "$res/decode_$w.json"
    grep " B: " "$res/decode_$w.log" >> "$res/summary.txt"
  done
  ;;
11)
  export NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1
  stacks() {  # after $1 s, every rank of graph_decode.py still there prints its stacks
    sleep "$1"
    for p in $(pgrep -f graph_decode.py); do
      grep -qa torchrun "/proc/$p/cmdline" || kill -SEGV "$p"
    done
  }
  decode() {  # decode NAME RANKS SECONDS SIZES
    stacks $(($3 - 15)) & local watch=$!
    step "$1" "$3" torchrun --nproc_per_node "$2" "$here/graph_decode.py" --sizes "$4" \
      --json "$res/$1.json"
    kill "$watch" 2>/dev/null
    grep " B: " "$res/$1.log" >> "$res/summary.txt"
  }
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
  decode decode2_ll 2 110 "${SIZES:-8K,32K,48K,56K,64K}"
  export UCCL_SG_GRAPH_LL_BYTES=0
  decode decode2_noll 2 80 "${SIZES_NOLL:-32K,64K}"
  unset UCCL_SG_GRAPH_LL_BYTES
  [ "$ngpu" -ge 4 ] && decode decode4_ll 4 110 "${SIZES:-8K,32K,48K,56K,64K}"
  ;;
esac
cat "$res/summary.txt"
tar -czf "$dest/part$PART.tgz" -C /tmp/campaign "part$PART"
cp "$res/summary.txt" "$dest/summary$PART.txt"
