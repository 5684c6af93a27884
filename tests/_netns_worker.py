"""One rank of tests/test_collective_netns.py, launched by torchrun inside a
network namespace ("node").  argv[1]: "copy" (use_copy_engine_for_intra=True)
or "dist" (False), both with cross-node peers over TCP; or "rdma": as "copy",
with cross-node peers over RDMA (the verbs emulator, its wire on the veth).
Env NETNS_EXPECT_IP: the address the engine must advertise.

Checks are recorded, not raised, so one mismatch does not desynchronise the
ranks; an exception (engine error, timeout) ends the rank at once.  Exit 0 only
if every check passed; every failure is printed as a 'NETNS-FAIL' line."""
from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

from uccl_collective import collective

MiB = 1 << 20
FAILS: list[str] = []


def check(ok: bool, what: str) -> None:
    if not ok:
        FAILS.append(what)
        print(f"NETNS-FAIL rank {dist.get_rank()}: {what}", flush=True)


def rand(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=dtype)
    return torch.randint(0, 256, (numel,), generator=g, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main() -> int:
    mode = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    me, n = dist.get_rank(), dist.get_world_size()
    my_node = int(os.environ["GROUP_RANK"])
    nodes: list = [None] * n
    dist.all_gather_object(nodes, my_node)
    check(len(set(nodes)) == 2, f"expected ranks on 2 nodes, got node ranks {nodes}")

    ctx = collective.init_collective(use_copy_engine_for_intra=(mode != "dist"), timeout_s=30)
    ip = ctx.ep.address()[0]
    check(ip == os.environ["NETNS_EXPECT_IP"],
          f"engine advertises {ip}, expected {os.environ['NETNS_EXPECT_IP']} "
          f"(UCCL_SOCKET_IFNAME={os.environ.get('UCCL_SOCKET_IFNAME')})")

    # -- transports --------------------------------------------------------
    ctx_tps = {p: ctx.transport_to(p) for p in range(n) if p != me}
    for p in range(n):
        if p == me:
            continue
        tp = ctx.transport_to(p)
        if nodes[p] != my_node:
            want = "rdma" if mode == "rdma" else "tcp"
            check(tp == want, f"transport_to({p}) (other node) = {tp!r}, expected {want!r}")
        elif mode != "dist":
            check(tp.startswith("shm"), f"transport_to({p}) (same node) = {tp!r}, expected shm-*")
        else:
            check(tp == "torch.distributed",
                  f"transport_to({p}) (same node) = {tp!r}, expected 'torch.distributed'")

    # -- allgather / allgatherv vs dist.all_gather ----------------------------
    for di, dtype in enumerate((torch.float32, torch.uint8)):
        esz = torch.empty(0, dtype=dtype).element_size()
        for numel in (0, 1, 1001, MiB // esz):
            for algo in ("direct", "ring"):
                tag = f"{dtype} numel={numel} algo={algo}"
                seed = ((me * 7 + di) * 3 + (algo == "ring")) * 10_000_000 + numel
                send = rand(numel, dtype, seed=seed)
                ref = [torch.empty_like(send) for _ in range(n)]
                dist.all_gather(ref, send)
                ref_flat = torch.cat(ref)

                recv = torch.full((n * numel,), 7, dtype=dtype)
                ctx.allgather(send, recv, algorithm=algo)
                check(same_bits(recv, ref_flat), f"allgather {tag}: differs from dist.all_gather")

                recv_l = [torch.full((numel,), 7, dtype=dtype) for _ in range(n)]
                ctx.allgather(send, recv_l, algorithm=algo)
                check(all(same_bits(a, b) for a, b in zip(recv_l, ref)),
                      f"allgather(list) {tag}: differs from dist.all_gather")

                # allgatherv: rank r contributes numel + 3*r elements (0 stays 0 on rank 0)
                counts = [numel + 3 * r if numel else (0 if r % 2 == 0 else 5) for r in range(n)]
                sendv = rand(counts[me], dtype, seed=seed + 5_000_000)
                padded = torch.zeros(max(counts), dtype=dtype)
                padded[:counts[me]] = sendv
                refv = [torch.empty_like(padded) for _ in range(n)]
                dist.all_gather(refv, padded)
                recvv = [torch.full((c,), 7, dtype=dtype) for c in counts]
                ctx.allgatherv(sendv, recvv, algorithm=algo)
                check(all(same_bits(recvv[r], refv[r][:counts[r]]) for r in range(n)),
                      f"allgatherv {tag} counts={counts}: differs from dist.all_gather")

    # -- a ring step whose every hop crosses the node boundary -----------------
    by_node = [[r for r in range(n) if nodes[r] == nd] for nd in sorted(set(nodes))]
    order = [r for pair in zip(*by_node) for r in pair]  # alternate nodes
    i = order.index(me)
    dst, src = order[(i + 1) % n], order[(i - 1) % n]
    check(nodes[dst] != my_node and nodes[src] != my_node,
          f"ring order {order}: hop {me}->{dst} or {src}->{me} does not cross nodes")
    for numel in (1, 1001, MiB // 4):
        out = rand(numel, torch.float32, seed=1000 + me)
        inn = torch.full((numel,), -1.0)
        ctx.sendrecv(out, dst, inn, src)
        check(same_bits(inn, rand(numel, torch.float32, seed=1000 + src)),
              f"sendrecv numel={numel} from rank {src} (node {nodes[src]}): wrong data")

    dist.barrier()
    collective.finalize_collective()
    dist.destroy_process_group()
    if FAILS:
        print(f"NETNS-FAIL rank {me}: {len(FAILS)} check(s) failed", flush=True)
        return 1
    tps = {p: ctx_tps[p] for p in sorted(ctx_tps)}
    print(f"NETNS-OK rank {me} node {my_node} mode {mode} ip {ip} transports {tps}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        rc = main()
    except BaseException:
        print(f"NETNS-FAIL rank {os.environ.get('RANK')}: exception\n{traceback.format_exc()}",
              flush=True)
        rc = 1
    sys.stdout.flush()
    os._exit(rc)  # no lingering threads keep a failed rank alive
