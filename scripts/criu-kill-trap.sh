#!/usr/bin/env bash
# CRIU alone, killed at a random moment of `criu dump`: how often does the
# dumped process die with it? (docs/RELIABILITY.md, "CRIU's own trap")
#
#   sudo [KILL_WITHIN_MS=300] bash scripts/criu-kill-trap.sh [TRIES]   (default 80)
#
# No criuz runs here: the workload is dumped by plain `criu dump
# --leave-stopped`, CRIU is SIGKILLed within KILL_WITHIN_MS, and the workload is
# continued once nothing traces it. A workload that ends is reported with
# the signal that ended it.
set -uo pipefail
cd "$(dirname "$0")/.."
tries=${1:-80}
criu=${CRIUZ_CRIU:-$HOME/.cache/criuz/criu-4.2.1/criu}
workload=./target/release/criuz-workload
work=$(mktemp -d /tmp/criu-kill-trap.XXXXXX)
trap 'rm -rf "$work"' EXIT
lost=0
for i in $(seq "$tries"); do
  rm -rf "$work/wl" "$work/img"; mkdir -p "$work/wl" "$work/img"
  "$workload" --dir "$work/wl" --mib 32 --pattern mixed </dev/null >/dev/null 2>&1 &
  w=$!
  until [ -s "$work/wl/ready" ]; do sleep 0.02; done
  "$criu" dump -t "$w" -D "$work/img" --leave-stopped -o dump.log >/dev/null 2>&1 &
  c=$!
  sleep "$(printf '0.%03d' $((RANDOM % ${KILL_WITHIN_MS:-300})))"
  kill -9 "$c" 2>/dev/null; wait "$c" 2>/dev/null
  for _ in $(seq 100); do
    grep -q "TracerPid:	0" "/proc/$w/status" 2>/dev/null && break
    sleep 0.01
  done
  kill -CONT "$w" 2>/dev/null
  sleep 0.2
  if kill -0 "$w" 2>/dev/null && ! grep -q "^State:	Z" "/proc/$w/status"; then
    kill -9 "$w"; wait "$w" 2>/dev/null
  else
    wait "$w"; st=$?
    echo "try $i: the workload ended, status $st ($(kill -l $((st - 128)) 2>/dev/null || echo exit))"
    lost=$((lost + 1))
  fi
done
echo "lost $lost of $tries"
