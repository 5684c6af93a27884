#!/usr/bin/env bash
# Fault trials on the multi-GPU machine in one call (issue 35): build in
# place, run tests/test_gpu_faults.py (TESTS=1), then
# benchmarks/gpu_fault_trials.py at each of WORLDS (default "2 4") with
# TRIALS trials an op (default 10), MODES (default "kill"; "stop" too),
# (STOP_TRIALS, default 2, for stop), OPS (default all), each capped so the call ends within BUDGET_S (570).
# Results under $OUT: faults_tests.txt, faults_w<W>_<mode>.{log,json}.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/device_build.sh"
nvidia-smi -L > "$out/gpus.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout -k 10 300 python3 -m pytest -q -rfs -p no:cacheprovider tests/test_gpu_faults.py \
    > "$out/faults_tests.txt" 2>&1
  echo "tests: rc=$? ($((SECONDS - start))s)"; tail -3 "$out/faults_tests.txt"
  grep -E "^FAILED|^ERROR" "$out/faults_tests.txt" | head -20
fi
for w in ${WORLDS:-2 4}; do
  for m in ${MODES:-kill}; do
    left=$(( ${BUDGET_S:-570} - (SECONDS - start) ))
    [ "$left" -gt 30 ] || { echo "no time left for w$w $m"; continue; }
    timeout -k 10 "$left" python3 benchmarks/gpu_fault_trials.py --world "$w" --mode "$m" \
      --trials "$([ "$m" = stop ] && echo "${STOP_TRIALS:-2}" || echo "${TRIALS:-10}")" ${OPS:+--ops "$OPS"} --json "$out/faults_w${w}_$m.json" \
      > "$out/faults_w${w}_$m.log" 2>&1
    echo "w$w $m: rc=$? ($((SECONDS - start))s)"
    grep -v WARNING "$out/faults_w${w}_$m.log" | grep -E "FAIL|passed|^\|" | head -40
  done
done
