#!/usr/bin/env bash
# One set of benchmarks on two builds of the engine, for a change that must
# not move performance (a refactor).  Each round runs both builds back to
# back, in alternating order, so both see the same machine state (this kind
# of VM changes speed within seconds: only ratios taken within a round mean
# much).  Every run also times Gloo's equivalent in the same run.  Prints
# each round, then per case the median of each build, the median of the
# per-round ratios (after / before; for latency, before / after, so > 1 is
# better either way) and their range, and each build's median ratio to Gloo
# (times better than Gloo, as the benchmarks report it).
#
#   git worktree add /tmp/before <rev> && (cd /tmp/before && python3 setup.py build_ext --inplace)
#   python3 setup.py build_ext --inplace
#   bash benchmarks/before_after.sh /tmp/before [AFTER_DIR] [ROUNDS]
#
# AFTER_DIR defaults to this checkout; ROUNDS to 5.  Cases: same-host p2p
# send/recv at 64 KiB and 256 MiB (GB/s) and the 64 KiB one-way latency
# (us), over shared memory; 2-rank allgather (direct, this engine only) at
# 1 MiB and 64 MiB per rank (busbw, GB/s); the 1 MiB dist.all_reduce
# through the "uccl" group (us); and benchmarks/overhead.py's 4-byte calls
# (p50 us).  Writes bench_out/before_after/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
before=$(cd "$1" && pwd)
after=$(cd "${2:-$here/..}" && pwd)
ROUNDS=${3:-5}
out=${OUT:-$here/../bench_out/before_after}
mkdir -p "$out"
rm -f "$out"/*.json
export UCCL_SOCKET_IFNAME=${UCCL_SOCKET_IFNAME:-lo}

# run BUILD NAME ROUND SCRIPT ARGS...: one benchmark of one build -> $out/NAME_ROUND_BUILDTAG.json
run() {
    local dir=$1 tag=$2 name=$3 round=$4 script=$5
    shift 5
    local cmp=(--compare gloo)
    [ "$script" = overhead.py ] && cmp=()   # it always times Gloo
    PYTHONPATH="$dir" timeout 600 torchrun --nproc_per_node 2 "$dir/benchmarks/$script" \
        "${cmp[@]}" --json "$out/${name}_r${round}_${tag}.json" "$@" > /dev/null 2>&1 ||
        { echo "failed: $tag $name round $round" >&2; exit 1; }
}

cases() {  # BUILD TAG ROUND
    # Small sizes get many iterations: 20 of them take microseconds, and a
    # round is then noise.
    run "$1" "$2" p2ps "$3" benchmark_uccl.py --transport shm --sizes 64K --iters 2000
    run "$1" "$2" p2p "$3" benchmark_uccl.py --transport shm --sizes 256M --iters 20
    run "$1" "$2" lat "$3" benchmark_uccl.py --transport shm --latency --sizes 64K --iters 2000
    run "$1" "$2" ags "$3" benchmark_uccl_collective.py --op allgather --algorithm direct \
        --sizes 1M --iters 500
    run "$1" "$2" ag "$3" benchmark_uccl_collective.py --op allgather --algorithm direct \
        --sizes 64M --iters 20
    run "$1" "$2" ar "$3" benchmark_uccl_collective.py --backend uccl --op allreduce \
        --sizes 1M --iters 200
    run "$1" "$2" ovh "$3" overhead.py --iters 2000
}

for round in $(seq "$ROUNDS"); do
    if (( round % 2 )); then
        cases "$before" before "$round"; cases "$after" after "$round"
    else
        cases "$after" after "$round"; cases "$before" before "$round"
    fi
    echo "round $round done" >&2
done

python3 - "$out" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def rows(name, r, tag):
    return {x["size"]: x for x in json.load(open(f"{out}/{name}_r{r}_{tag}.json"))["results"]}

cases = [("p2ps", 65536, "uccl_GBps", "GB/s", 1), ("p2p", 268435456, "uccl_GBps", "GB/s", 1),
         ("lat", 65536, "uccl_p50_us", "us", -1),
         ("ags", 1 << 20, "uccl_busbw_GBps", "GB/s", 1), ("ag", 64 << 20, "uccl_busbw_GBps", "GB/s", 1),
         ("ar", 1 << 20, "uccl_us", "us", -1)]
label = {"p2ps": "p2p send/recv shm", "p2p": "p2p send/recv shm", "lat": "p2p one-way latency shm",
         "ags": "allgather 2 ranks", "ag": "allgather 2 ranks", "ar": "dist.all_reduce 2 ranks"}
print(f"{'case':<28} {'size':>8} {'before':>9} {'after':>9}  {'ratio':>6}  {'x Gloo (before, after)':>22}"
      f"  (range of {rounds} rounds)")
for name, size, field, unit, better in cases:
    b = [rows(name, r, "before")[size][field] for r in range(1, rounds + 1)]
    a = [rows(name, r, "after")[size][field] for r in range(1, rounds + 1)]
    ratio = [(x / y) if better > 0 else (y / x) for x, y in zip(a, b)]
    med = statistics.median
    gb = med(rows(name, r, "before")[size]["ratio"] for r in range(1, rounds + 1))
    ga = med(rows(name, r, "after")[size]["ratio"] for r in range(1, rounds + 1))
    s = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    print(f"{label[name]:<28} {s:>8} {med(b):>7.2f}{unit[:2]:>2} {med(a):>7.2f}{unit[:2]:>2}  "
          f"{med(ratio):>5.2f}x  {gb:>10.2f}x, {ga:>6.2f}x  "
          f"({min(ratio):.2f}-{max(ratio):.2f}; before {min(b):.2f}-{max(b):.2f}, "
          f"after {min(a):.2f}-{max(a):.2f} {unit})")

# overhead.py: each uccl path's p50 (us), and Gloo's p50 over it
def ovh(r, tag):
    return {x["path"]: x for x in json.load(open(f"{out}/ovh_r{r}_{tag}.json"))["results"]}
for path in [k for k, x in ovh(1, "before").items() if x["impl"] == "uccl"]:
    b = [ovh(r, "before")[path]["p50_us"] for r in range(1, rounds + 1)]
    a = [ovh(r, "after")[path]["p50_us"] for r in range(1, rounds + 1)]
    ratio = [y / x for x, y in zip(a, b)]
    med = statistics.median
    gb = med(1 / ovh(r, "before")[path]["x_gloo_p50"] for r in range(1, rounds + 1))
    ga = med(1 / ovh(r, "after")[path]["x_gloo_p50"] for r in range(1, rounds + 1))
    print(f"{path[:28]:<28} {'4 B':>8} {med(b):>7.2f}us {med(a):>7.2f}us  {med(ratio):>5.2f}x  "
          f"{gb:>10.2f}x, {ga:>6.2f}x  ({min(ratio):.2f}-{max(ratio):.2f}; before "
          f"{min(b):.2f}-{max(b):.2f}, after {min(a):.2f}-{max(a):.2f} us)")
PY
