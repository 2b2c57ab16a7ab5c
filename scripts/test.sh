#!/usr/bin/env bash
# criuz test suite: unit, format, golden and corruption tests, the streamer
# protocol against a fake CRIU (no root needed), real-CRIU round trips and
# attacks (as root; CI always runs them and fails if CRIU is missing), the
# fuzz regressions and a short fuzz run, lint and doc links, a benchmark smoke run and the
# fault campaign's short form (criuz-faults).
# Run scripts/setup.sh first.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"

cargo fmt --all -- --check
cargo clippy --release --locked --workspace --all-targets -q -- -D warnings
# Module docs are the design notes: every link in them must resolve.
RUSTDOCFLAGS="-D warnings" cargo doc --release --locked --workspace --no-deps --document-private-items -q
cargo build --release --locked --workspace -q
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --release --locked --workspace 2>&1 | tee "$log"
read -r passed failed < <(awk '/^test result:/ { p += $4; f += $6 } END { print p + 0, f + 0 }' "$log")

# A short structured fuzz run over every archive reader (the long runs are
# made by hand: target/release/criuz-fuzz --seconds 3600 --corpus DIR).
crashes=$(mktemp -d)
if ./target/release/criuz-fuzz --seconds 20 --crashes "$crashes"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
rm -rf "$crashes"

if [ "$(id -u)" -eq 0 ]; then
  out=$(mktemp -d)
  if ./target/release/criuz-bench --quick --json "$out/bench.json" --plot "$out/bench.png" &&
    ./target/release/criuz-bench --quick --incremental --workloads mixed,redis --json "$out/incremental.json" &&
    ./target/release/criuz-bench --quick --workloads mixed --configs criuz-s3,criuz-s3-stream,criuz+boto3 --json "$out/s3.json" &&
    ./target/release/criuz-bench --quick --containers --json "$out/containers.json" &&
    ./target/release/criuz-bench --quick --workloads mixed --configs criuz-lz4,criuz-lz4-stream,criuz-zstd-stream --cold --json "$out/fill.json" &&
    ./target/release/criuz-bench --quick --workloads bf16 --configs criuz-lz4-flat,criuz-zstd-ids --json "$out/flat.json" &&
    ./target/release/criuz-bench --quick --load 2 --workloads mixed --json "$out/load.json"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
  # The fault campaign's short form (docs/RELIABILITY.md): 36 faults on
  # every path, each followed by the retry, every invariant checked.
  if ./target/release/criuz-faults --faults 36 --json "$out/faults.json"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
  rm -rf "$out"
else
  echo "SKIP: criuz-bench --quick and criuz-faults need root (CRIU); CI runs them as root"
fi

echo "tests: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
