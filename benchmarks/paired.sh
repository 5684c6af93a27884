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

# pairs TITLE REF_NAME REF_CMD FIELD OURS_ARGS...: ROUNDS rounds of the reference
# command then our benchmark, printing both and their ratio (ours / reference).
pairs() {
    local title=$1 name=$2 ref=$3 field=$4
    shift 4
    echo "== $title"
    local r=() u o x
    for i in $(seq "$ROUNDS"); do
        u=$(eval "$ref")
        o=$(FIELD=$field ours "$@")
        x=$(python3 -c "print(round($o / $u, 2))")
        r+=("$x")
        printf '  round %d: %s %.2f  uccl %.2f  ratio %sx\n' "$i" "$name" "$u" "$o" "$x"
    done
    summary "${r[@]}"
}

pairs "same host, 256 MiB send/recv vs ucx_perftest tag_bw UCX_TLS=posix,self (GB/s)" ucx \
    "ucx tag_bw 268435456 20 | awk '{print \$2 * 1048576 / 1e9}'" \
    uccl_GBps --sizes 256M --iters 20 --transport shm
pairs "same host, 64 KiB one-way latency vs ucx_perftest tag_lat UCX_TLS=posix,self (us; ratio uccl/ucx)" ucx \
    "ucx tag_lat 65536 20000 | awk '{print \$1}'" \
    uccl_p50_us --latency --sizes 64K --iters 2000 --transport shm
pairs "TCP loopback, 256 MiB send/recv vs iperf3 one stream (GB/s)" iperf3 \
    "iperf" \
    uccl_GBps --sizes 256M --iters 20 --transport tcp
