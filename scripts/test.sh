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
cargo test --release --locked

if [ "$(id -u)" -eq 0 ]; then
  out=$(mktemp -d)
  ./target/release/criuz bench --quick --json "$out/bench.json" --plot "$out/bench.png"
  rm -rf "$out"
else
  echo "SKIP: criuz bench --quick needs root (CRIU); CI runs it as root"
fi
