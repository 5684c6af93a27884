#!/usr/bin/env bash
# CPU allgather: Open MPI MPI_Allgather, then this engine (direct and ring,
# each with Gloo's all_gather_into_tensor timed in the same run), back to
# back, ROUNDS times per world size.  This VM changes speed within seconds,
# so every ratio is taken within one round and the table shows the median
# over rounds.  Writes bench_out/allgather_paired/*.json{,l} and prints:
#   world size | uccl busbw | ratio to Gloo | ratio to MPI | ring / direct
#
#   ROUNDS=3 WORLDS="2 4" SIZES="1M,4M,16M,64M" bash benchmarks/allgather_paired.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
ROUNDS=${ROUNDS:-3}
WORLDS=${WORLDS:-"2 4"}
SIZES=${SIZES:-"1M,4M,16M,64M"}
ITERS=${ITERS:-20}
out=${OUT:-$root/bench_out/allgather_paired}
mkdir -p "$out"
rm -f "$out"/*.json "$out"/*.jsonl
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
bytes=$(python3 -c "import sys; sys.path.insert(0, '$here'); from bench_common import parse_sizes; print(' '.join(map(str, parse_sizes('$SIZES'))))")

for round in $(seq "$ROUNDS"); do
  for n in $WORLDS; do
    WORLDS=$n SIZES="$bytes" bash "$here/mpi_baseline.sh" -i "$ITERS" > "$out/mpi_n${n}_r${round}.jsonl"
    for algo in direct ring; do
      torchrun --nproc_per_node "$n" "$here/benchmark_uccl_collective.py" --op allgather \
        --algorithm "$algo" --sizes "$SIZES" --iters "$ITERS" --compare gloo \
        --json "$out/uccl_${algo}_n${n}_r${round}.json" > /dev/null 2>&1 \
        || { echo "benchmark failed: n=$n algo=$algo round=$round" >&2; exit 1; }
    done
  done
done

python3 - "$out" "$ROUNDS" "$WORLDS" <<'PY'
import json, statistics, sys
out, rounds, worlds = sys.argv[1], int(sys.argv[2]), [int(w) for w in sys.argv[3].split()]
med = statistics.median
print(f"{'ranks':>5} {'size/rank':>9} {'uccl busbw':>10} {'x Gloo':>7} {'x MPI':>6} "
      f"{'ring/direct':>11}   (medians of {rounds} paired rounds; busbw GB/s, nccl-tests)")
for n in worlds:
    per = {}
    for r in range(1, rounds + 1):
        mpi = {j["bytes_per_rank"]: j for j in map(json.loads, open(f"{out}/mpi_n{n}_r{r}.jsonl"))}
        d = {x["size"]: x for x in json.load(open(f"{out}/uccl_direct_n{n}_r{r}.json"))["results"]}
        g = {x["size"]: x for x in json.load(open(f"{out}/uccl_ring_n{n}_r{r}.json"))["results"]}
        for s, x in d.items():
            e = per.setdefault(s, {"bus": [], "gloo": [], "mpi": [], "ring": []})
            e["bus"].append(x["uccl_busbw_GBps"])
            e["gloo"].append(x["ratio"])
            e["mpi"].append(x["uccl_busbw_GBps"] / mpi[s]["busbw_gbs"])
            e["ring"].append(g[s]["uccl_busbw_GBps"] / x["uccl_busbw_GBps"])
    for s, e in sorted(per.items()):
        print(f"{n:>5} {s >> 20:>7} MiB {med(e['bus']):>10.2f} {med(e['gloo']):>7.2f} "
              f"{med(e['mpi']):>6.2f} {med(e['ring']):>11.2f}")
PY
