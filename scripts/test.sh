#!/usr/bin/env bash
# criuz test suite: unit, format and corruption tests, real-CRIU round trips
# (as root; CI always runs them and fails if CRIU is missing), lint, and a
# benchmark smoke run. Run scripts/setup.sh first.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"

cargo fmt --all -- --check
cargo clippy --release --locked --all-targets -q -- -D warnings
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --release --locked 2>&1 | tee "$log"
read -r passed failed < <(awk '/^test result:/ { p += $4; f += $6 } END { print p + 0, f + 0 }' "$log")

if [ "$(id -u)" -eq 0 ]; then
  out=$(mktemp -d)
  ./target/release/criuz bench --quick --json "$out/bench.json" --plot "$out/bench.png"
  rm -rf "$out"
else
  echo "SKIP: criuz bench --quick needs root (CRIU); CI runs it as root"
fi

echo "tests: $passed passed, $failed failed"
