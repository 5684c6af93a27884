"""A decode step captured as one CUDA graph, with the "uccl" backend against
NCCL captured the same way, in the same run (a GPU per rank):

    torchrun --nproc_per_node 2 benchmarks/graph_decode.py [--sizes 8K,16K,32K,64K]

Per layer (--layers, default 32): a matmul of a [tokens, hidden] bf16
activation by a [hidden, hidden] weight, then an all_reduce in bf16 of the
layer's output, whose size is the row's (tokens x hidden x 2 bytes; hidden
--hidden, default 4096, so 8 KiB is one token).  The whole step is captured
once per backend and size, replayed --warmup times, then timed over --iters
replays (CUDA events around each replay; the median).  Then, twice, the
captured input is given fresh values and each graph replayed once more, and
uccl's output is checked against NCCL's: bitwise at two ranks, whose sums
do not depend on the order; else the norm of the difference within 5% of
NCCL's output's (NCCL's ring rounds each partial sum to bf16, uccl sums in
fp32 and rounds once, which 32 layers compound; a stale replay is off by
about 140%).  A replay that read a previous replay's bytes would pass a
check on the timed replays, whose inputs never change.  Reported per size: the step's time, the time an
all_reduce adds (the step less the same step with no all_reduce, captured
too), and uccl's over NCCL's.  --json writes the rows."""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from bench_common import parse_sizes  # noqa: E402 (this folder is on sys.path)

REL_BOUND = 0.05   # beyond two ranks: |uccl - NCCL| / |NCCL|, the whole output


def step_graph(layers, x, ws, group):
    """The decode step captured: x <- all_reduce(x @ w) per layer (group
    None: no all_reduce)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def body():
        y = x
        for w in layers:
            y = y @ w
            if group is not None:
                dist.all_reduce(y, group=group)
        return y
    with torch.cuda.stream(side):   # warm up outside the capture, as torch asks
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = body()
    return g, out


def time_graph(g, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spans = []
    for _ in range(iters):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        spans.append(a.elapsed_time(b) * 1e3)
    return statistics.median(spans)


def size_row(nb, args, rank, ws, nccl, uccl) -> dict:
    """One size's row: the three steps captured, timed and checked.  The
    graphs die with this call: NCCL's communicator, destroyed at the end,
    waits for the graphs that hold its work to go first."""
    tokens = max(1, nb // (2 * args.hidden))
    gen = torch.Generator(device="cuda").manual_seed(1234)   # the same weights everywhere
    layers = [torch.randn(args.hidden, args.hidden, device="cuda", dtype=torch.bfloat16,
                          generator=gen) / (args.hidden ** 0.5 * ws)
              for _ in range(args.layers)]   # (/ ws: the sum of ws ranks keeps the scale)
    row = {"bytes": tokens * args.hidden * 2, "tokens": tokens, "layers": args.layers}
    graphs = {}
    for name, group in (("none", None), ("nccl", nccl), ("uccl", uccl)):
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(99 + rank))
        g, out = step_graph(layers, x, ws, group)
        row[f"{name}_us"] = time_graph(g, args.iters, args.warmup)
        graphs[name] = (g, x, out)
    for trial in range(2):   # fresh inputs: a stale read shows
        fresh = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(
                                7000 + 100 * trial + rank))
        outs = {}
        for name in ("nccl", "uccl"):
            g, x, out = graphs[name]
            x.copy_(fresh)
            g.replay()
            torch.cuda.synchronize()
            outs[name] = out.clone()
        u, v = outs["uccl"].double(), outs["nccl"].double()
        err = ((u - v).norm() / v.norm()).item()
        row["check_err"] = max(row.get("check_err", 0.0), err)
        if (ws == 2 and not torch.equal(u, v)) or not err <= REL_BOUND:   # (NaN fails)
            raise SystemExit(f"rank {rank}, {row['bytes']} B, check {trial}: uccl's step "
                             f"differs from NCCL's (relative error {err:.3g})")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8K,16K,32K,64K",
                   help="all_reduce bytes a layer (bf16; a multiple of 2 x --hidden)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", default="")
    args = p.parse_args()
    import uccl_collective  # noqa: F401 - registers "uccl"
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("uccl")
    nccl = dist.new_group(backend="nccl")
    uccl = dist.group.WORLD
    rows = []
    for nb in parse_sizes(args.sizes):
        row = size_row(nb, args, rank, ws, nccl, uccl)
        for name in ("nccl", "uccl"):
            row[f"{name}_ar_us"] = (row[f"{name}_us"] - row["none_us"]) / args.layers
        row["ratio"] = row["uccl_ar_us"] / row["nccl_ar_us"] if row["nccl_ar_us"] > 0 else None
        rows.append(row)
        if rank == 0:
            print(f"{row['bytes']:>7} B: step uccl {row['uccl_us']:.1f} us, NCCL "
                  f"{row['nccl_us']:.1f}, no all_reduce {row['none_us']:.1f}; an all_reduce "
                  f"adds uccl {row['uccl_ar_us']:.2f} us, NCCL {row['nccl_ar_us']:.2f} "
                  f"(x{row['ratio']:.2f}; checked, relative error {row['check_err']:.2g})",
                  flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world": ws, "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
