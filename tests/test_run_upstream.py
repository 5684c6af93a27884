"""benchmarks/run_upstream.py's multi-GPU set and its ours-vs-NCCL table,
on CPU: the entries at 2 and 4 ranks, the parsers fed lines printed the way
upstream's allgather and alltoall benchmarks (and their NCCL baselines)
print them, and the script itself reporting the set as not run here."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("run_upstream", ROOT / "benchmarks" / "run_upstream.py")
ru = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ru)


def _pretty(n):   # the size format of upstream's benchmarks (_pretty_size)
    val = float(n)
    for u in ["B", "KB", "MB", "GB"]:
        if val < 1024 or u == "GB":
            return f"{val:.0f} {u}" if u == "B" else f"{val:.1f} {u}"
        val /= 1024


def _allgather_output(title, figures, ranks=2):
    """What rank 0 of benchmark_{uccl,nccl}_allgather.py prints: a banner,
    one line per size, and the summary table."""
    out = ["=" * 60, title, "=" * 60, f"World size: {ranks}", "=" * 60]
    for size, ms, algbw in figures:
        out.append(f"\n🚀 Running benchmark: size={_pretty(size)}, count={size // 4}")
        out.append(f"   Send: {_pretty(size):>10} | Recv: {_pretty(ranks * size):>10} | "
                   f"Time: {ms:.3f} ms | AlgBW: {algbw:.2f} GB/s | "
                   f"BusBW: {algbw * (ranks - 1) / ranks:.2f} GB/s")
    out += ["", "=" * 80, "Summary", "=" * 80,
            f"{'Size':>12} | {'Send':>10} | {'Recv':>10} | {'Time (ms)':>10} | "
            f"{'AlgBW (GB/s)':>12} | {'BusBW (GB/s)':>12}", "-" * 80]
    for size, ms, algbw in figures:
        out.append(f"{_pretty(size):>12} | {_pretty(size):>10} | {_pretty(ranks * size):>10} | "
                   f"{ms:>10.3f} | {algbw:>12.2f} | {algbw / 2:>12.2f}")
    return "\n".join(out + ["=" * 80])


def _a2a_ours(figures):   # benchmark_uccl_alltoall.py, rank 0
    out = ["[Rank 0] UCCL Collective initialized successfully"]
    for block, mb, bw in figures:
        out += [f"\n🚀 Running benchmark with block_size={block}", "warmup_all2all_check",
                "FCP P2P Alltoall Iteration 1/10 completed",
                f"block_size={block // 1024}K, msg_sz={mb:.2f}MB, avg_bw={bw:.2f}GB/s"]
    out.append("\n================ Summary =================")
    out += [f"Block={b // 1024}K | Msg={mb:.2f}MB | BW={bw:.2f}GB/s" for b, mb, bw in figures]
    return "\n".join(out + ["=========================================\n"])


def _a2a_nccl(figures):   # benchmark_nccl_alltoall.py, rank 0
    header = f"{'Block Size':>12} | {'Msg Size (MB)':>12} | {'Avg BW (GB/s)':>12}"
    out = ["\n================ Summary ================", header, "-" * len(header)]
    out += [f"{f'{b // 1024}K':>12} | {f'{mb:.2f}':>12} | {f'{bw:.2f}':>12}" for b, mb, bw in figures]
    return "\n".join(out + ["=========================================\n",
                            "✅ Results saved to nccl_benchmark_results.csv"])


def test_allgather_figures_parsed_per_size():
    out = _allgather_output("UCCL AllGather Benchmark",
                            [(65536, 0.021, 6.24), (1048576, 0.150, 13.98), (16777216, 1.9, 17.66)])
    assert ru.parse_figures("allgather", out, True) == {
        "64.0 KB": 6.24, "1.0 MB": 13.98, "16.0 MB": 17.66}
    # torchrun's "[rank0]: " prefix, where it adds one, is no obstacle
    pre = "\n".join("[rank0]: " + ln for ln in out.splitlines())
    assert ru.parse_figures("allgather", pre, True)["1.0 MB"] == 13.98


def test_alltoall_figures_parsed_in_each_format():
    figs = [(1024, 4.0, 11.5), (16384, 64.0, 120.25)]
    want = {"4.00 MiB (block 1K)": 11.5, "64.00 MiB (block 16K)": 120.25}
    assert ru.parse_figures("alltoall", _a2a_ours(figs), True) == want
    assert ru.parse_figures("alltoall", _a2a_nccl(figs), False) == want
    # each format is read by its own parser only
    assert ru.parse_figures("alltoall", _a2a_nccl(figs), True) == {}
    assert ru.parse_figures("alltoall", _a2a_ours(figs), False) == {}


def _row(name, output, result="pass"):
    return dict(name=name, result=result, output=output)


def test_comparison_sets_ours_against_nccl():
    results = [
        _row("benchmark_uccl_allgather", _allgather_output("UCCL AllGather Benchmark",
                                                           [(65536, 0.02, 5.0), (1048576, 0.1, 20.0)])),
        _row("benchmark_nccl_allgather", _allgather_output("NCCL AllGather Benchmark (Baseline)",
                                                           [(65536, 0.01, 10.0), (1048576, 0.1, 40.0)])),
        _row("benchmark_uccl_alltoall", _a2a_ours([(1024, 4.0, 30.0)])),
        _row("benchmark_nccl_alltoall", _a2a_nccl([(1024, 4.0, 60.0), (4096, 16.0, 90.0)])),
    ]
    rows = ru.compare(results)
    got = {(r["op"], r["size"]): (r["ours"], r["nccl"], r["ratio"]) for r in rows}
    assert got == {("allgather", "64.0 KB"): (5.0, 10.0, 0.5),
                   ("allgather", "1.0 MB"): (20.0, 40.0, 0.5),
                   ("alltoall", "4.00 MiB (block 1K)"): (30.0, 60.0, 0.5),
                   ("alltoall", "16.00 MiB (block 4K)"): (None, 90.0, None)}
    md = ru.compare_markdown(rows)
    assert "## ours vs NCCL" in md
    assert "| allgather | 1.0 MB | AlgBW GB/s (ranks x size received / time) | 20.00 | 40.00 | 0.50 |" in md
    assert "| 16.00 MiB (block 4K) | GB/s (MiB of one block / ms, ring send/recv) |  | 90.00 |  |" in md


def test_comparison_names_the_side_without_figures():
    results = [_row("benchmark_uccl_allgather", "Traceback ...", result="fail"),
               _row("benchmark_nccl_allgather", _allgather_output("NCCL", [(65536, 0.01, 10.0)]))]
    rows = ru.compare(results)
    assert len(rows) == 1 and rows[0]["note"] == "no figures from benchmark_uccl_allgather"
    assert ru.compare([_row("benchmark_uccl_allgather", "")]) == []   # no baseline ran: no row


@pytest.mark.parametrize("ranks", [2, 4])
def test_multi_gpu_entries_per_rank_count(ranks):
    multi = {e["name"]: e for e in ru.entries(ranks) if e["multi"]}
    modes = ["", " --async-api", " --dual", " --ring"]
    assert set(multi) == {*(f"benchmark_uccl_collective{m}" for m in modes),
                          "benchmark_uccl_allgather", "benchmark_uccl_alltoall",
                          "benchmark_nccl_allgather", "benchmark_nccl_alltoall", "test_engine_nvlink"}
    for name, e in multi.items():
        if e["only_ranks"]:   # upstream asserts 2 ranks in these
            assert (e["launcher"], e["gpus"], e["only_ranks"]) == ("torchrun:2", 2, 2), name
        else:
            assert (e["launcher"], e["gpus"]) == (f"torchrun:{ranks}", ranks), name
    assert {n for n, e in multi.items() if e["only_ranks"]} == {
        "benchmark_uccl_collective", "benchmark_uccl_collective --async-api",
        "benchmark_uccl_collective --dual", "test_engine_nvlink"}
    assert "pynccl.py" in " ".join(multi["benchmark_nccl_alltoall"]["extras"])
    assert ru.ENTRIES == ru.entries(2)


def test_multi_gpu_set_reported_not_run_without_gpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for e in ru.entries(4):   # placeholders: nothing of the set runs on a machine without GPUs
        if e["multi"]:
            (src / pathlib.Path(e["paths"][0]).name).write_text("raise SystemExit(3)\n")
    if ru.machine()["gpus"]:
        pytest.skip("this machine has a GPU: the set would run the placeholders")
    out = tmp_path / "out.json"
    md = tmp_path / "out.md"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_upstream.py"), "--src", str(src),
                        "--multi-gpu", "--ranks", "4", "--json", str(out), "--markdown", str(md)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["results"]}
    assert data["ranks"] == 4 and data["comparison"] == [] and len(rows) == 9
    assert all(r["result"] == "not run" for r in rows.values()), rows
    assert rows["benchmark_uccl_collective --ring"]["why"].startswith("needs 4 GPU(s)")
    assert "accepts 2 ranks only" in rows["benchmark_uccl_collective --dual"]["why"]
    assert "test_engine_send" not in rows
    assert "| benchmark_nccl_alltoall | not run |" in md.read_text()


def test_nvtx_stub_gives_the_annotate_upstream_uses(tmp_path):
    (tmp_path / "nvtx.py").write_text(ru.NVTX_STUB)
    code = ("import nvtx\nwith nvtx.annotate('iter 0'):\n    x = 1\n"
            "with nvtx.annotate(message='m', color='red'):\n    x += 1\nprint(x)")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and p.stdout.strip() == "2", p.stderr


def test_end_to_end_table_from_scripts_that_print_like_upstream(tmp_path):
    """The whole path (copy, torchrun with 2 ranks, capture, parse, write)
    with stand-ins that print rank 0's lines as upstream's scripts do; the
    machine is told it has 2 GPUs, since nothing here touches one."""
    src = tmp_path / "src"
    src.mkdir()
    outputs = {
        "benchmark_uccl_allgather": _allgather_output("UCCL AllGather Benchmark",
                                                      [(65536, 0.02, 5.0), (1048576, 0.1, 20.0)]),
        "benchmark_nccl_allgather": _allgather_output("NCCL AllGather Benchmark (Baseline)",
                                                      [(65536, 0.01, 10.0), (1048576, 0.1, 40.0)]),
        "benchmark_uccl_alltoall": _a2a_ours([(1024, 4.0, 30.0)]),
        "benchmark_nccl_alltoall": _a2a_nccl([(1024, 4.0, 60.0)]),
    }
    for name, text in outputs.items():
        (src / f"{name}.py").write_text(
            "import os\n" + ("import nvtx\n" if "alltoall" in name else "") +
            f"if os.environ.get('LOCAL_RANK') == '0':\n    print({text!r})\n")
    out = tmp_path / "out.json"
    md = tmp_path / "out.md"
    driver = (f"import importlib.util, sys\n"
              f"spec = importlib.util.spec_from_file_location('ru', {str(ROOT / 'benchmarks' / 'run_upstream.py')!r})\n"
              "ru = importlib.util.module_from_spec(spec); spec.loader.exec_module(ru)\n"
              "ru.machine = lambda: dict(gpus=2, rdma=False)\n"
              f"sys.argv = ['run_upstream.py', '--src', {str(src)!r}, '--multi-gpu', '--nvtx-stub',"
              f" '--timeout', '120', '--json', {str(out)!r}, '--markdown', {str(md)!r}, '--only',"
              f" *{list(outputs)!r}]\n"
              "sys.exit(ru.main())\n")
    p = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=400,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["result"] for r in data["results"]] == ["pass"] * 4, data["results"]
    assert all("output" not in r for r in data["results"])
    got = {(r["op"], r["size"]): r["ratio"] for r in data["comparison"]}
    assert got == {("allgather", "64.0 KB"): 0.5, ("allgather", "1.0 MB"): 0.5,
                   ("alltoall", "4.00 MiB (block 1K)"): 0.5}
    assert "| allgather | 64.0 KB | AlgBW GB/s (ranks x size received / time) | 5.00 | 10.00 | 0.50 |" \
        in md.read_text()
