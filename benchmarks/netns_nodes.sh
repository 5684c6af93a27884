#!/usr/bin/env bash
# Two "nodes" on one machine, for the backend's algorithms across nodes:
# two network namespaces joined by a veth pair (its rate cut to RATE with
# tc's token bucket, e.g. 1gbit; none: the veth's own), one torchrun per
# namespace (2 ranks each, world 4; static rendezvous), and in each the
# benchmark below once per UCCL_PG_ALGO in ALGOS, back to back:
#
#   sudo RATE=1gbit ALGOS="auto hier" SIZES=4M,16M bash benchmarks/netns_nodes.sh
#
# Inside a node the ranks move bytes over shared memory, between nodes
# over TCP on the veth (the namespaces share one kernel; torchrun's
# GROUP_RANK tells the nodes apart).  Needs root and iproute2 (tc for RATE).
# The rest of the arguments go to benchmark_uccl_collective.py (default:
# --backend uccl --op allreduce --rounds 3).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
rate=${RATE:-}
ns=(ucclb$$n0 ucclb$$n1)
veth=(ub$$a ub$$b)
addr=(10.213.78.1 10.213.78.2)
cleanup() {
  for n in "${ns[@]}"; do
    for p in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null || true
  done
}
trap cleanup EXIT
for n in "${ns[@]}"; do ip netns add "$n"; done
ip -n "${ns[0]}" link add "${veth[0]}" type veth peer name "${veth[1]}"
ip -n "${ns[0]}" link set "${veth[1]}" netns "${ns[1]}"
for i in 0 1; do
  ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${veth[$i]}"
  ip -n "${ns[$i]}" link set "${veth[$i]}" up
  ip -n "${ns[$i]}" link set lo up
  if [ -n "$rate" ]; then   # each direction's sender shapes its own way out
    ip netns exec "${ns[$i]}" tc qdisc add dev "${veth[$i]}" root tbf rate "$rate" \
      burst 256kb latency 50ms
  fi
done
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--backend uccl --op allreduce --rounds 3)
for algo in ${ALGOS:-auto hier}; do
  echo "== UCCL_PG_ALGO=$algo${rate:+, veth at $rate}"
  pids=()
  for i in 0 1; do
    ip netns exec "${ns[$i]}" env PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" \
      UCCL_PG_ALGO="$algo" UCCL_SOCKET_IFNAME="${veth[$i]}" GLOO_SOCKET_IFNAME="${veth[$i]}" \
      OMP_NUM_THREADS=1 UCCL_P2P_LOG_LEVEL=ERROR TORCH_CPP_LOG_LEVEL=ERROR \
      timeout 600 python3 -m torch.distributed.run --nnodes 2 --node_rank "$i" \
      --nproc_per_node 2 --rdzv_backend static --master_addr "${addr[0]}" \
      --master_port 29533 --max_restarts 0 "$here/benchmark_uccl_collective.py" \
      --sizes "${SIZES:-4M,16M}" "${args[@]}" > "/tmp/netns_nodes.$$.$i.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  grep -E "^\[Rank 0\] [A-Z]|busbw .* us" "/tmp/netns_nodes.$$.0.log" || true
  [ "$rc" = 0 ] || { echo "the job failed (rc $rc):"; tail -20 "/tmp/netns_nodes.$$.0.log"; }
done
