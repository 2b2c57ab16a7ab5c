#!/usr/bin/env bash
# Sends SIGTERM to a foreground `criuz restore` at 0-3 ms after its pidfile
# names the tree, N times (default 40), and counts the signals that never
# reached the tree's root (criuz still waiting 10 s later). As root, after
# scripts/setup.sh. CRIUZ=path picks another criuz build (to compare one
# from before a change); FILL='--fill stream' or '--lazy' another path.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
B=$ROOT/target/release
CRIUZ=${CRIUZ:-$B/criuz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
lost=0 bad=0
for i in $(seq "${N:-40}"); do
  rm -rf w a.criuz pf && mkdir w
  setsid "$B/criuz-workload" --dir w --mib 16 --pattern mixed >/dev/null 2>&1 </dev/null &
  while [ ! -s w/ready ]; do sleep 0.01; done
  pid=$(cat w/ready)
  "$CRIUZ" dump -t "$pid" -o a.criuz >/dev/null 2>&1 || { echo "round $i: the dump failed"; bad=$((bad + 1)); continue; }
  # Its pid is taken until init reaps the dumped process.
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  sleep 1.2
  # shellcheck disable=SC2086
  "$CRIUZ" restore -i a.criuz --pidfile pf ${FILL:---fill place} >r.log 2>&1 &
  c=$!
  while [ ! -s pf ] && kill -0 "$c" 2>/dev/null; do :; done
  d=$((RANDOM % 4))
  [ "$d" -gt 0 ] && sleep "0.00$d"
  kill -TERM "$c"
  for _ in $(seq 100); do kill -0 "$c" 2>/dev/null || break; sleep 0.1; done
  was_lost=0
  if kill -0 "$c" 2>/dev/null; then
    was_lost=1
    echo "round $i (after ${d} ms): the signal was lost, criuz still waits"
    lost=$((lost + 1))
    kill -KILL "$pid" "$c" 2>/dev/null
  fi
  wait "$c" 2>/dev/null
  st=$?
  # The workload exits 0 on SIGTERM, and criuz as it does.
  [ "$st" -ne 0 ] && [ "$was_lost" -eq 0 ] && { echo "round $i: criuz exited $st"; cat r.log; bad=$((bad + 1)); }
  sleep 0.3
done 2> >(grep -v Killed >&2)
echo "signals lost: $lost of ${N:-40}; other failures: $bad"
[ "$lost" -eq 0 ] && [ "$bad" -eq 0 ]
