#!/usr/bin/env bash
# rootfs.sh DIR [BINARY...]
#
# Builds a minimal container root filesystem in DIR for runc/podman tests:
# a static busybox (bin/busybox plus a symlink per applet: sh, sleep, cat...),
# empty /proc /dev /sys /tmp mount points and etc/passwd+group. Each BINARY
# is copied into DIR/bin together with the shared libraries ldd names
# (including the dynamic loader), each at its own absolute path under DIR.
# Needs busybox-static (apt-get install busybox-static). Safe to re-run.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 DIR [BINARY...]" >&2
    exit 2
fi
dir=$1
shift

busybox=${BUSYBOX:-}
if [ -z "$busybox" ]; then
    for b in /bin/busybox /usr/bin/busybox; do
        [ -x "$b" ] && busybox=$b && break
    done
fi
if [ -z "$busybox" ]; then
    echo "rootfs.sh: busybox not found (apt-get install busybox-static)" >&2
    exit 1
fi
if LC_ALL=C ldd "$busybox" >/dev/null 2>&1; then
    echo "rootfs.sh: $busybox is dynamically linked; install busybox-static" >&2
    exit 1
fi

mkdir -p "$dir"/{bin,sbin,etc,proc,sys,dev,root,run,var/tmp,tmp}
chmod 1777 "$dir/tmp" "$dir/var/tmp"
chmod 0700 "$dir/root"

# Copies SRC to DIR/DST, replacing (not following) a symlink already there.
put() {
    local src=$1 dst=$dir$2
    mkdir -p "$(dirname "$dst")"
    if [ -e "$dst" ] && [ ! -L "$dst" ] && cmp -s "$src" "$dst"; then
        return
    fi
    cp -L --remove-destination "$src" "$dst"
}

put "$busybox" /bin/busybox
chmod 0755 "$dir/bin/busybox"
for applet in $("$busybox" --list); do
    [ "$applet" = busybox ] && continue
    link=$dir/bin/$applet
    # Leave binaries copied in by name (e.g. a real ls) alone.
    if [ -e "$link" ] && [ ! -L "$link" ]; then
        continue
    fi
    ln -sfn busybox "$link"
done

if [ ! -e "$dir/etc/passwd" ]; then
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$dir/etc/passwd"
fi
if [ ! -e "$dir/etc/group" ]; then
    printf 'root:x:0:\nnogroup:x:65534:\n' >"$dir/etc/group"
fi
touch "$dir/etc/hosts" "$dir/etc/resolv.conf" "$dir/etc/hostname"

for bin in "$@"; do
    if [ ! -f "$bin" ]; then
        echo "rootfs.sh: no such binary: $bin" >&2
        exit 1
    fi
    put "$bin" "/bin/$(basename "$bin")"
    chmod 0755 "$dir/bin/$(basename "$bin")"
    # ldd fails on static binaries ("not a dynamic executable"): nothing to copy.
    libs=$(LC_ALL=C ldd "$bin" 2>/dev/null || true)
    # "libx.so => /path (0x..)" and "/lib64/ld-linux-x86-64.so.2 (0x..)";
    # linux-vdso has no path and is skipped.
    while read -r lib; do
        if [ -n "$lib" ]; then put "$lib" "$lib"; fi
    done < <(printf '%s\n' "$libs" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
done
