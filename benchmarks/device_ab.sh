#!/usr/bin/env bash
# A/B on the GPU machine under CUDA MPS: the 4-process CollectiveContext
# allgather (ag_ipc) of an older tree against this one, alternating, in one
# call.  Prepare the older tree here first, then carry it along:
#   echo _ab >> .git/info/exclude; mkdir -p _ab/old
#   git archive REV | tar -x -C _ab/old        # e.g. REV=8e26b33 (issue 11's run 6)
#   (device) bash benchmarks/device_ab.sh       with carry=["_ab"]
set -uo pipefail
out=${OUT:-bench_out/device}
mkdir -p "$out"; out=$(cd "$out" && pwd)
export CUDA_MPS_PIPE_DIRECTORY=/tmp/uccl-mps CUDA_MPS_LOG_DIRECTORY=/tmp/uccl-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT && echo "MPS on"
( cd _ab/old && python3 setup.py build_ext --inplace -q > "$out/ab_build_old.log" 2>&1 ) || { echo "old build failed"; tail "$out/ab_build_old.log"; }
for round in 1 2; do
  for tree in old new; do
    dir=$([ $tree = old ] && echo _ab/old || echo .)
    ( cd "$dir" && PYTHONPATH=$PWD UCCL_P2P_LOG_LEVEL=ERROR timeout 90 torchrun --nproc_per_node 4 \
        benchmarks/benchmark_uccl_collective.py --device gpu --timeout 60 --compare ipc-copy \
        --sizes 64K,1M,16M --iters 50 > "$out/ab_${tree}_$round.log" 2>&1 )
    echo "$tree round $round: rc=$?"
    grep -E "^\[Rank 0\]|busbw" "$out/ab_${tree}_$round.log" | head -8
  done
done
