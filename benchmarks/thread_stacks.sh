#!/usr/bin/env bash
# thread_stacks.sh PID SECONDS [EVERY]: what every thread of PID and of its
# descendants waits in, sampled every EVERY seconds (default 1) for SECONDS:
# each thread's name, kernel wait channel and kernel stack (/proc, as
# root), and where gdb is installed its user-space stack (every 4th sample).
# For a hang that lasts a few seconds (a timeout that fires), where a
# debugger cannot be sat at by hand.  Output on stdout.
set -u
root=$1 secs=$2 every=${3:-1}
tree() { local p=$1; echo "$p"; for c in $(cat /proc/"$p"/task/*/children 2>/dev/null); do tree "$c"; done; }
have_gdb=0; command -v gdb >/dev/null && have_gdb=1
echo "gdb: $have_gdb"
for i in $(seq 0 $((secs / every))); do
  kill -0 "$root" 2>/dev/null || break
  echo "=== sample $i at $(date +%s.%N)"
  for p in $(tree "$root"); do
    echo "--- pid $p: $(tr '\0' ' ' < /proc/"$p"/cmdline 2>/dev/null | cut -c1-120)"
    for t in /proc/"$p"/task/*; do
      printf '%s %s %s\n' "${t##*/}" "$(cat "$t"/comm 2>/dev/null)" "$(cat "$t"/wchan 2>/dev/null)"
      sed 's/^/    /' "$t"/stack 2>/dev/null | head -8
    done
    if [ "$have_gdb" = 1 ] && [ $((i % 4)) = 2 ]; then
      timeout 20 gdb -p "$p" -batch -nx -ex "thread apply all bt 12" 2>/dev/null | grep -E "^Thread|^#" | head -400
    fi
  done
  sleep "$every"
done
