#!/usr/bin/env bash
# The 16-core and GPU measurements of issues 33 and 34, on the lent device
# machine (16 cores, an H100; see ../shared/gpu/README.md). Each part is one
# device command, sized to stay under its 10-minute limit; the JSON goes to
# $OUT (the device's returned folder) or /tmp/criuz-device.
#
# Here, once: scripts/setup.sh, cargo build --release --workspace, then
#   bash ../shared/gpu/kit.sh && echo /.dev/ >> .git/info/exclude
# There (the run tool, carry [".dev"]):
#   bash bench/device.sh scale     # 4 GiB mixed/text/random/elf: criu-dir vs criuz (placed) vs stream
#   bash bench/device.sh cpus      # scaling: --cpus 2, 4, 8, 16 on 4 GiB mixed
#   bash bench/device.sh cold      # cold page cache: read rate against a plain read of the file
#   bash bench/device.sh lazy      # time to running and to every page in, 4 GiB mixed
#   bash bench/device.sh lazy-cold # the same from a dropped page cache
#   bash bench/device.sh gpu CONFIG  # the GPU app (issue 34), one of criu-dir, criuz-lz4, criuz-zstd
#                                    # a command: each takes minutes at this size
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PWD/.dev/bin:$PATH
out=${OUT:-/tmp/criuz-device}
mkdir -p "$out"
B=(criuz-bench --criu "$PWD/.dev/bin/criu")
nproc
case ${1:-} in
  scale)
    "${B[@]}" --size 4096 --runs 1 --workloads mixed,text,random,elf \
      --configs criu-dir,criu-tmpfs,criuz-lz4,criuz-zstd,criuz-lz4-stream --json "$out/scale16.json"
    ;;
  cpus)
    for n in 2 4 8 16; do
      "${B[@]}" --cpus "$n" --size 4096 --runs 1 --workloads mixed \
        --configs criu-dir,criuz-lz4,criuz-lz4-stream --json "$out/cpus-$n.json"
    done
    ;;
  cold)
    "${B[@]}" --cold --size 4096 --runs 1 --workloads mixed,text \
      --configs criu-dir,criuz-lz4,criuz-zstd --json "$out/cold16.json"
    ;;
  lazy)
    "${B[@]}" --lazy --size 4096 --runs 3 --workloads mixed --json "$out/lazy16.json"
    ;;
  lazy-cold)
    "${B[@]}" --lazy --cold --size 4096 --runs 1 --workloads mixed --json "$out/lazy16-cold.json"
    ;;
  gpu)
    # 4 GiB weights, 12 GiB KV cache (25% filled): a 21.7 GB host image.
    c=${2:?"gpu: which configuration (criu-dir, criuz-lz4, criuz-zstd)"}
    "${B[@]}" --gpu --configs "$c" --runs 1 --cold --json "$out/gpu-$c.json"
    ;;
  *)
    echo "usage: bench/device.sh scale|cpus|cold|lazy|lazy-cold|gpu CONFIG" >&2
    exit 2
    ;;
esac
