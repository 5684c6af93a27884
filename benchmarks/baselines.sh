#!/usr/bin/env bash
# Reference figures for the p2p benchmark, measured on *this* machine.
#
# The numbers in DESIGN.md §4 come from other machines and the CI box is noisy,
# so every comparison should be made against figures taken in the same session.
# This script installs the tools (idempotently) and prints one line per figure:
#     what | size | figure units
# All bandwidths are GB/s = 1e9 bytes/s; all latencies are microseconds (one way).
#
# Usage: benchmarks/baselines.sh            (needs root for apt-get / pip)
#        PYTHON=/path/to/python benchmarks/baselines.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0   # pinned: an unpinned torch pulls gigabytes of CUDA wheels
REPEAT=${REPEAT:-3}    # samples per UCX/Gloo figure (see summarise below)
PORT=${BASELINE_PORT_BASE:-13500}  # each server gets its own port, so a socket
                                   # still in TIME_WAIT never makes a run fail

# ---------------------------------------------------------------- install ---
if ! command -v ucx_perftest >/dev/null || ! command -v iperf3 >/dev/null; then
    # Only refresh the package lists when apt does not know the packages yet;
    # the update is the slow part and is not needed on a warm machine.
    if ! apt-cache show ucx-utils iperf3 >/dev/null 2>&1; then
        apt-get update -qq
    fi
    # noninteractive: iperf3's debconf asks whether to start a daemon.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ucx-utils iperf3 >/dev/null
fi
if ! "$PYTHON" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    "$PYTHON" -m pip install -q "torch==$TORCH_VERSION"
fi

# --------------------------------------------------------------- cleanup ---
# Servers run in the background (under timeout, which passes SIGTERM on);
# an error or ^C must not leave one holding a port. `jobs -p` lists only our
# own still-running jobs, so nothing else can be hit.
TMP="$(mktemp -d)"
cleanup() {
    local p
    for p in $(jobs -p); do kill "$p" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT

line() {  # what, size, figure, units
    printf '%-52s %8s  %9s %s\n' "$1" "$2" "$3" "$4"
}

# ------------------------------------------------------------------- UCX ---
# ucx_perftest columns (UCX 1.13, verified in src/tools/perf/perftest.c):
#   Final: iters | lat p50 | lat avg | lat overall | bw avg | bw overall | msg/s avg | msg/s overall
# Bandwidth "MB/s" is bytes/s / (1024*1024), so GB/s = MB/s * 1048576 / 1e9.
# For ping-pong tests (tag_lat) the latency is already round trip / 2
# (checked: 500k iterations at 7.19 us took 7.3 s of wall time).
# -w matters: the default warmup is 10000 iterations, minutes at 64 MiB.
# Not called in $(...): a subshell would lose the PORT increment.
ucx_run() {  # tls test size iters warmup -> sets UCX_FINAL to the "Final:" line
    local tls=$1 test=$2 size=$3 iters=$4 warmup=$5 port=$((PORT++)) out=$TMP/ucx.$PORT
    UCX_TLS=$tls timeout 120 ucx_perftest -p "$port" >"$out.srv" 2>&1 &
    local spid=$!
    sleep 0.5   # the server must be listening before the client connects
    if ! UCX_TLS=$tls timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t "$test" \
            -s "$size" -n "$iters" -w "$warmup" >"$out.cli" 2>&1; then
        echo "ucx_perftest failed (UCX_TLS=$tls -t $test -s $size):" >&2
        cat "$out.cli" "$out.srv" >&2
        kill "$spid" 2>/dev/null || true
        wait "$spid" 2>/dev/null || true
        return 1
    fi
    wait "$spid" || true
    UCX_FINAL=$(grep '^Final:' "$out.cli") || { cat "$out.cli" >&2; return 1; }
}

# Summarise repeated measurements as "median (min-max)": on this 2-core VM the
# same test swings by 2-4x between runs (e.g. tag_lat 2 us vs 8 us), apparently
# depending on where the host places the two vCPUs, so one sample can mislead.
summarise() {  # values... -> sets MEDIAN and SPREAD ("min-max"); call directly, not in $(...)
    local sorted
    sorted=$(printf '%s\n' "$@" | sort -g)
    SPREAD="$(head -1 <<<"$sorted")-$(tail -1 <<<"$sorted")"
    MEDIAN=$(awk '{v[NR]=$1} END {printf "%.2f", (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}' <<<"$sorted")
}

ucx_bw() {  # tls size iters warmup label
    local vals=() i
    for ((i = 0; i < REPEAT; i++)); do
        ucx_run "$1" tag_bw "$2" "$3" "$4" || { line "ucx_perftest tag_bw, UCX_TLS=$1" "$5" FAILED ""; return 0; }
        vals+=("$(awk '{printf "%.2f", $7 * 1048576 / 1e9}' <<<"$UCX_FINAL")")  # overall MB/s -> GB/s
    done
    summarise "${vals[@]}"
    line "ucx_perftest tag_bw, UCX_TLS=$1" "$5" "$MEDIAN" "GB/s (range $SPREAD, n=$REPEAT)"
}

ucx_lat() {  # tls size iters warmup label
    local vals=() i
    for ((i = 0; i < REPEAT; i++)); do
        ucx_run "$1" tag_lat "$2" "$3" "$4" || { line "ucx_perftest tag_lat one-way, UCX_TLS=$1" "$5" FAILED ""; return 0; }
        vals+=("$(awk '{printf "%.2f", $5}' <<<"$UCX_FINAL")")  # overall average, already one way
    done
    summarise "${vals[@]}"
    line "ucx_perftest tag_lat one-way, UCX_TLS=$1" "$5" "$MEDIAN" "us (range $SPREAD, n=$REPEAT)"
}

# Iteration counts keep each run to a second or two at ~3-8 GB/s.
ucx_bw  posix,self  $((64 << 20))  50 5 "64 MiB"
ucx_bw  posix,self  $((256 << 20)) 20 3 "256 MiB"
ucx_lat posix,self  $((64 << 10))  50000 1000 "64 KiB"
ucx_bw  tcp,self    $((64 << 20))  30 5 "64 MiB"

# ---------------------------------------------------------------- iperf3 ---
# -1: the server exits after one test, so nothing lingers; the sleep gives it
# time to bind. sum_received is what actually arrived (sum over streams).
iperf_run() {  # streams
    local streams=$1 port=$((PORT++)) out=$TMP/iperf.$1
    timeout 30 iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
    local spid=$!
    sleep 0.5
    if ! timeout 30 iperf3 -c 127.0.0.1 -p "$port" -t 5 -P "$streams" -J >"$out.json" 2>"$out.err"; then
        kill "$spid" 2>/dev/null || true
        line "iperf3 loopback, $streams stream(s)" "-" FAILED ""
        return 0
    fi
    wait "$spid" || true
    line "iperf3 loopback, $streams stream(s)" "-" \
        "$("$PYTHON" -c 'import json,sys; print("%.2f" % (json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"] / 8 / 1e9))' "$out.json")" GB/s
}

iperf_run 1
iperf_run 4

# ------------------------------------------------------------------ Gloo ---
# The comparison our extension is really measured against: torch.distributed
# Gloo between two processes on this host.
"$PYTHON" "$HERE/gloo_baseline.py" --rounds "$REPEAT"
