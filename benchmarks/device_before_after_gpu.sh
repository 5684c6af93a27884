#!/usr/bin/env bash
# GPU before/after for a change that must not move performance (a refactor),
# on a machine of two or more GPUs, one process per GPU, each run timing its
# reference in the same run (NCCL, the raw CUDA IPC copy, or Gloo).  Builds
# this tree and an earlier one in place, then ROUNDS rounds (default 2),
# each running both trees back to back in alternating order, of:
#   ar   dist.all_reduce through "uccl", 4 B / 1 MiB / 16 MiB, vs NCCL
#   ag   dist.all_gather_into_tensor through "uccl", same sizes, vs NCCL
#   ctx  CollectiveContext.allgather, 64 KiB / 1 MiB / 16 MiB, vs NCCL
#   p2p  Endpoint send/recv GPU to GPU, 64 KiB / 16 MiB / 256 MiB, vs the raw IPC copy
#   ovh  benchmarks/overhead.py --device gpu: 4-byte calls, vs Gloo
# The earlier source travels as an ignored folder (no .git there):
#
#   mkdir -p bench_out/before_src && git archive <rev> | tar -x -C bench_out/before_src
#   device run (kind nvidia-h100-x2): bash benchmarks/device_before_after_gpu.sh
#                                     (carry bench_out/before_src)
#
# Results: $out/ba_gpu.txt (per case and size: each tree's median us, the
# after/before time ratio of each round, each tree's median ratio to its
# reference) and the JSON of every run packed in $out/ba_gpu.tgz.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/device_build.sh"
before=bench_out/before_src
(cd "$before" && python3 setup.py build_ext --inplace -q) > "$out/build_before.log" 2>&1 ||
    { echo "build of $before failed"; tail -20 "$out/build_before.log"; exit 1; }
ROUNDS=${ROUNDS:-2}
DEV=${DEV:-gpu}    # DEV=cpu REF=gloo: the same runs on CPU tensors (a dry run of this script)
REF=${REF:-nccl}
CASES=${CASES:-ar ag ctx p2p ovh}   # which of the cases below
res=$(mktemp -d)
echo "builds done ($((SECONDS - start)) s)"

run() {  # TREE TAG CASE ROUND SCRIPT ARGS...
    local dir=$1 tag=$2 name=$3 round=$4 script=$5
    shift 5
    [[ " $CASES " == *" $name "* ]] || return 0
    (cd "$dir" && PYTHONPATH=$PWD timeout 150 torchrun --nproc_per_node 2 "benchmarks/$script" \
        --json "$res/${name}_r${round}_${tag}.json" "$@" > "$res/${name}_r${round}_${tag}.log" 2>&1) ||
        echo "failed: $tag $name round $round (see the log in ba_gpu.tgz)"
}

cases() {  # TREE TAG ROUND
    run "$1" "$2" ar "$3" benchmark_uccl_collective.py --device $DEV --backend uccl --op allreduce \
        --compare $REF --sizes 4,1M,16M --iters 200 --warmup 20 --timeout 60
    run "$1" "$2" ag "$3" benchmark_uccl_collective.py --device $DEV --backend uccl --op allgather \
        --compare $REF --sizes 4,1M,16M --iters 200 --warmup 20 --timeout 60
    run "$1" "$2" ctx "$3" benchmark_uccl_collective.py --device $DEV --op allgather \
        --compare $REF --sizes 64K,1M,16M --iters 200 --warmup 20 --timeout 60
    run "$1" "$2" p2p "$3" benchmark_uccl.py --device $DEV --sizes 64K,16M,256M --iters 50 \
        --timeout 60
    run "$1" "$2" ovh "$3" overhead.py --device $DEV --iters 1000
}

for round in $(seq "$ROUNDS"); do
    if (( round % 2 )); then
        cases "$before" before "$round"; cases . after "$round"
    else
        cases . after "$round"; cases "$before" before "$round"
    fi
    echo "round $round done ($((SECONDS - start)) s)"
done

python3 - "$res" "$ROUNDS" "$DEV" "$CASES" <<'PY' | tee "$out/ba_gpu.txt"
import glob, json, os, statistics, sys
res, rounds = sys.argv[1], int(sys.argv[2])
dev = "cuda" if sys.argv[3] == "gpu" else "cpu"
med = statistics.median

def load(name, r, tag):
    p = f"{res}/{name}_r{r}_{tag}.json"
    return json.load(open(p))["results"] if os.path.exists(p) else None

print(f"{'case':<5} {'size / path':<34} {'before us':>10} {'after us':>10} {'after/before':>14}"
      f"  {'x ref (before, after)':>22}")
for name in sys.argv[4].split():
    runs = {(r, t): load(name, r, t) for r in range(1, rounds + 1) for t in ("before", "after")}
    if any(v is None for v in runs.values()):
        print(f"{name:<5} missing runs: {sorted(k for k, v in runs.items() if v is None)}")
        continue
    if name == "ovh":
        keys = [(x["device"], x["path"]) for x in runs[(1, "before")] if x["impl"] == "uccl"
                and x["device"] == dev]
        get = lambda rows, k: next(x for x in rows if (x["device"], x["path"]) == k)
        for k in keys:
            b = [get(runs[(r, "before")], k)["p50_us"] for r in range(1, rounds + 1)]
            a = [get(runs[(r, "after")], k)["p50_us"] for r in range(1, rounds + 1)]
            xb = med(get(runs[(r, "before")], k)["x_gloo_p50"] for r in range(1, rounds + 1))
            xa = med(get(runs[(r, "after")], k)["x_gloo_p50"] for r in range(1, rounds + 1))
            rat = ", ".join(f"{y / x:.2f}" for x, y in zip(b, a))
            print(f"{name:<5} {k[1]:<34} {med(b):10.1f} {med(a):10.1f} {rat:>14}"
                  f"  {1 / xb:10.2f}x, {1 / xa:8.2f}x (Gloo p50 / uccl p50)")
        continue
    for row in runs[(1, "before")]:
        size = row["size"]
        get = lambda rows: next(x for x in rows if x["size"] == size)
        us = "uccl_us" if "uccl_us" in row else None
        if us is None:   # benchmark_uccl.py: bandwidth; us per message from it
            b = [size / get(runs[(r, "before")])["uccl_GBps"] / 1e3 for r in range(1, rounds + 1)]
            a = [size / get(runs[(r, "after")])["uccl_GBps"] / 1e3 for r in range(1, rounds + 1)]
        else:
            b = [get(runs[(r, "before")])[us] for r in range(1, rounds + 1)]
            a = [get(runs[(r, "after")])[us] for r in range(1, rounds + 1)]
        xb = med(get(runs[(r, "before")]).get("ratio", float("nan")) for r in range(1, rounds + 1))
        xa = med(get(runs[(r, "after")]).get("ratio", float("nan")) for r in range(1, rounds + 1))
        rat = ", ".join(f"{y / x:.2f}" for x, y in zip(b, a))
        print(f"{name:<5} {row['size_str']:<34} {med(b):10.1f} {med(a):10.1f} {rat:>14}"
              f"  {xb:10.2f}x, {xa:8.2f}x ({row.get('ref', 'ref')} busbw ratio)")
PY
tar -czf "$out/ba_gpu.tgz" -C "$res" .
echo "done ($((SECONDS - start)) s)"
