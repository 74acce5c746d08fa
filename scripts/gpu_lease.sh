#!/usr/bin/env bash
# A GPU lease worked by detached drivers and kept alive by back-to-back calls of this script: the machine goes
# back 30 s after a call ends without the next one, and a call runs at most 10 minutes, so a session's checks run
# detached and each call only waits, reports and packs what they wrote.
#
#   bash scripts/gpu_lease.sh SECONDS DRIVER [DRIVER ...]     (from the tree's root, on the GPU machine)
#
# The first call copies the offline bundle (.devbundle, carried) to /tmp/devbundle-src (install_on_device.sh keeps
# its parts in /tmp/devbundle: a bundle read from there would be copied onto itself) and the DRIVERs (bash
# scripts, usually in a git-ignored carried folder) to /tmp/lease/, then runs them one after the other, detached,
# from this tree, with R=/tmp/r (their results) and BUNDLE=/tmp/devbundle-src in the environment, into
# /tmp/r/<driver>.log; /tmp/r/progress gets "HH:MM:SS start|end <driver> [exit]" and /tmp/r/done follows the last.
# Every call touches each file of .lease-flags/ (carried) into /tmp/r/ (a driver tests them between its stages,
# e.g. `[ -f $R/skip_bench ]`), waits up to SECONDS or until done, prints the progress and the tail of each
# summary.txt under /tmp/r, and packs /tmp/r into $OUT/r.tgz. "lease done" in the output: nothing runs any more.
#
# A driver calls scripts/gpu_check.sh with `--bundle "$BUNDLE"` and `OUT=$R/<stage>`; it must not read files of
# carried folders after its start (every call replaces them), nor change csrc/ (a rebuild under the run).
set -uo pipefail
WAIT=${1:?seconds to wait}
shift
R=/tmp/r
mkdir -p "$R"
for flag in .lease-flags/*; do [ -f "$flag" ] && touch "$R/$(basename "$flag")"; done
if [ ! -f "$R/started" ]; then
  [ $# -gt 0 ] || { echo "no driver given"; exit 2; }
  touch "$R/started"
  rm -rf /tmp/devbundle-src /tmp/lease && mkdir -p /tmp/lease
  [ -d .devbundle ] && cp -r .devbundle /tmp/devbundle-src
  cp "$@" /tmp/lease/
  names=()
  for d in "$@"; do names+=("$(basename "$d")"); done
  tree=$(pwd)
  # shellcheck disable=SC2016  # expanded by the detached shell
  setsid nohup bash -c 'cd "$1" && shift && for d in "$@"; do
      echo "$(date +%T) start $d" >> /tmp/r/progress
      R=/tmp/r BUNDLE=/tmp/devbundle-src bash "/tmp/lease/$d" > "/tmp/r/$d.log" 2>&1
      rc=$?
      echo "$(date +%T) end $d $rc" >> /tmp/r/progress
    done; touch /tmp/r/done' lease "$tree" "${names[@]}" > /dev/null 2>&1 < /dev/null &
fi
end=$((SECONDS + WAIT))
while [ $SECONDS -lt $end ] && [ ! -f "$R/done" ]; do sleep 5; done
date +%T
cat "$R/progress" 2>/dev/null
find "$R" -name summary.txt | sort | while read -r f; do echo "--- $f"; tail -n 8 "$f" | cut -c1-200; done
[ -f "$R/done" ] && echo "lease done"
tar -czf "${OUT:-/tmp/out}/r.tgz" -C /tmp r 2> /dev/null
