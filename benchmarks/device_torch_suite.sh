#!/usr/bin/env bash
# One call on the GPU machine (no registry there): build in place, then run
# torch's own distributed suite (benchmarks/torch_suite.py) on CUDA tensors
# at 2 ranks sharing GPU 0, with "uccl" and with Gloo as the reference (NCCL
# cannot serve two ranks on one GPU there).  Only the suite's CUDA cases
# (tests named *cuda*/*gpu*) unless TESTS=name,name... or K=substring.
# Results under $OUT/torch_suite (torch_suite.md: counts and every test
# whose outcome differs; results_*.jsonl; log_*.txt).  About 8 minutes at
# most: each backend's run is cut at RUN_TIMEOUT seconds (default 200).
set -uo pipefail
source "$(dirname "$0")/device_build.sh"
sel=()
[ -n "${TESTS:-}" ] && sel=(--tests "$TESTS")
[ -n "${K:-}" ] && sel=(-k "$K")
timeout 520 python3 benchmarks/torch_suite.py --device cuda --world-sizes "${WORLDS:-2}" \
  --backends "${BACKENDS:-uccl,gloo}" --timeout "${RUN_TIMEOUT:-200}" --test-timeout 60 \
  --out "$out/torch_suite" "${sel[@]}" > "$out/torch_suite.log" 2>&1
echo "torch_suite rc=$?"
cat "$out/torch_suite/torch_suite.md" 2>/dev/null || tail -30 "$out/torch_suite.log"
