#!/usr/bin/env bash
# The issue's comparisons, measured as pairs: each round runs the reference
# tool and benchmark_uccl.py back to back, so both see the same machine state
# (this kind of VM flips between fast and slow modes within seconds; compare
# figures taken minutes apart and the ratio means little).  Prints one line a
# round with both figures and their ratio, then the median ratio.
#
#   bash benchmarks/paired.sh [ROUNDS]        (needs ucx-utils, iperf3: see baselines.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" UCCL_SOCKET_IFNAME=${UCCL_SOCKET_IFNAME:-lo}
PORT=14100
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

ucx() {  # ucx_perftest <test> <size> <iters> -> its "Final:" line's fields
    PORT=$((PORT + 1))
    UCX_TLS=posix,self timeout 120 ucx_perftest -p $PORT >/dev/null 2>&1 &
    sleep 0.4
    UCX_TLS=posix,self timeout 120 ucx_perftest 127.0.0.1 -p $PORT -t "$1" -s "$2" -n "$3" -w 3 \
        2>/dev/null | awk '/Final:/ {print $3, $7}'
    wait
}
iperf() {  # one iperf3 stream for 3 s over loopback, GB/s (1e9)
    PORT=$((PORT + 1))
    timeout 30 iperf3 -s -1 -B 127.0.0.1 -p $PORT >/dev/null 2>&1 &
    sleep 0.3
    timeout 30 iperf3 -c 127.0.0.1 -p $PORT -t 3 -P 1 -J 2>/dev/null |
        python3 -c "import json,sys; print(json.load(sys.stdin)['end']['sum_received']['bits_per_second']/8e9)"
    wait
}
ours() {  # benchmark_uccl.py args... -> the JSON field named by $FIELD of its one row
    torchrun --nproc_per_node 2 benchmarks/benchmark_uccl.py --compare none --json "$OUT/r.json" "$@" \
        >/dev/null 2>&1
    python3 -c "import json; print(json.load(open('$OUT/r.json'))['results'][0]['$FIELD'])"
}
summary() { python3 -c "import statistics,sys; v=[float(x) for x in sys.argv[1:]]; print(f'  median ratio {statistics.median(v):.2f}x (min {min(v):.2f}, max {max(v):.2f}, n={len(v)})')" "$@"; }

echo "== same host, 256 MiB send/recv vs ucx_perftest tag_bw UCX_TLS=posix,self (GB/s)"
r=()
for i in $(seq "$ROUNDS"); do
    u=$(ucx tag_bw 268435456 20 | awk '{print $2 * 1048576 / 1e9}')
    o=$(FIELD=uccl_GBps ours --sizes 256M --iters 20 --transport shm)
    x=$(python3 -c "print(round($o / $u, 2))"); r+=("$x")
    printf '  round %d: ucx %.2f  uccl %.2f  ratio %sx\n' "$i" "$u" "$o" "$x"
done
summary "${r[@]}"

echo "== same host, 64 KiB one-way latency vs ucx_perftest tag_lat UCX_TLS=posix,self (us; ratio uccl/ucx)"
r=()
for i in $(seq "$ROUNDS"); do
    u=$(ucx tag_lat 65536 20000 | awk '{print $1}')   # median
    o=$(FIELD=uccl_p50_us ours --latency --sizes 64K --iters 2000 --transport shm)
    x=$(python3 -c "print(round($o / $u, 2))"); r+=("$x")
    printf '  round %d: ucx %.2f  uccl %.2f  ratio %sx\n' "$i" "$u" "$o" "$x"
done
summary "${r[@]}"

echo "== TCP loopback, 256 MiB send/recv vs iperf3 one stream (GB/s)"
r=()
for i in $(seq "$ROUNDS"); do
    u=$(iperf)
    o=$(FIELD=uccl_GBps ours --sizes 256M --iters 20 --transport tcp)
    x=$(python3 -c "print(round($o / $u, 2))"); r+=("$x")
    printf '  round %d: iperf3 %.2f  uccl %.2f  ratio %sx\n' "$i" "$u" "$o" "$x"
done
summary "${r[@]}"
