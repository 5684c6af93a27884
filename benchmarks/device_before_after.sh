#!/usr/bin/env bash
# One call on the GPU machine for a change that must not move anything (a
# refactor): build this checkout and an earlier one in place, run the whole
# test suite on this one, then benchmarks/before_after.sh on both.  The
# earlier source travels as an ignored folder (no .git there):
#
#   mkdir -p bench_out/before_src && git archive <rev> | tar -x -C bench_out/before_src
#   device run: bash benchmarks/device_before_after.sh   (carry bench_out/before_src)
#
# Logs go to $OUT (or ./bench_out/device).  ROUNDS (default 3); TESTS=0 skips
# the tests, TEST_FILES picks them (default: all of tests/).
set -uo pipefail
source "$(dirname "$0")/device_build.sh"
before=bench_out/before_src
(cd "$before" && python3 setup.py build_ext --inplace -q) > "$out/build_before.log" 2>&1 ||
    { echo "build of $before failed"; tail -20 "$out/build_before.log"; exit 1; }
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider ${TEST_FILES:-tests} > "$out/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$out/tests.log"
fi
OUT="$out/ba" bash benchmarks/before_after.sh "$before" . "${ROUNDS:-3}" 2> "$out/before_after.err" |
    tee "$out/before_after.txt"
