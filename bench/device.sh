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
#   bash bench/device.sh write-rate # one thread writing 4 GiB to the page cache, then sync
#   bash bench/device.sh gpu CONFIG  # the GPU app (issue 34), one of criu-dir, criuz-lz4, criuz-zstd
#                                    # a command: each takes minutes at this size
#   bash bench/device.sh gpu-no-ids  # the GPU app, criuz-zstd dumping with --no-ids
#   bash bench/device.sh gpu-no-planes # the GPU app, criuz-lz4 dumping with --no-planes (dump CPU)
#   bash bench/device.sh planes-cpu # criuz pack --ids of 512 MiB gpu-image with and without planes, -j 16/8/4
#   bash bench/device.sh gpu-eager CONFIG # criuz-lz4 or criuz-lz4-flat (--no-planes), eager restore only
#   bash bench/device.sh gpu-runs  # more runs for medians: zstd, criu-dir, zstd, lz4, criu-dir
#   bash bench/device.sh table     # issue 33's 4 GiB table, medians of RUNS (3): criuz-lz4 against
#                                  # criu-dir (mixed, text) and criu-dir+sync (random, elf)
#   bash bench/device.sh session   # what one call has time for (BUDGET_S, 540 s), issue 33 first:
#                                  # the table, lazy, zstd (scale), cold reads, then --cpus 2 and 16
# SIZE (MiB, 4096) and CONFIGS override the sizes and configurations of scale, cpus and cold.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PWD/.dev/bin:$PATH
out=${OUT:-/tmp/criuz-device}
mkdir -p "$out"
B=(criuz-bench --criu "$PWD/.dev/bin/criu")
# Where the CRIU built by scripts/setup.sh keeps its kernel cache (CRIU
# keeps one only on a tmpfs). /run there is no tmpfs (session 81), so a small
# one is mounted on /run/criu, as scripts/setup.sh does here: without it every
# CRIU start probes the kernel again, a lazy tree's start above all.
mkdir -p -m 0700 /run/criu
mountpoint -q /run/criu || mount -t tmpfs -o mode=0700 criuz-kdat /run/criu || true
size=${SIZE:-4096}
nproc
# A dump holds about (descriptors - spare) blocks by reference, a sealed block one
# descriptor (src/archive/held.rs).
echo "descriptors: $(ulimit -Sn) soft, $(ulimit -Hn) hard"
# What criuz finds of the machine: CRIU and its own check, userfaultfd,
# CRIU's kernel cache, the CUDA driver and its GPUs.
criuz check --criu "$PWD/.dev/bin/criu" || true
case ${1:-} in
  scale)
    "${B[@]}" --size "$size" --runs 1 --workloads mixed,text,random,elf \
      --configs "${CONFIGS:-criu-dir,criu-dir+sync,criu-tmpfs,criuz-lz4,criuz-zstd,criuz-lz4-stream}" \
      --json "$out/scale16.json"
    ;;
  table)
    # Issue 33's 16-core table, medians of RUNS (3): the default codec
    # against what each pattern's targets name: criu-dir for mixed and
    # text, criu-dir then sync for random and elf (their archives stay
    # large; its frozen time and restore are criu-dir's).
    "${B[@]}" --size "$size" --runs "${RUNS:-3}" --workloads mixed,text --configs criu-dir,criuz-lz4 \
      --json "$out/table-mixed-text.json"
    "${B[@]}" --size "$size" --runs "${RUNS:-3}" --workloads random,elf --configs criu-dir+sync,criuz-lz4 \
      --json "$out/table-random-elf.json"
    ;;
  cpus)
    for n in 2 4 8 16; do
      "${B[@]}" --cpus "$n" --size "$size" --runs 1 --workloads mixed \
        --configs "${CONFIGS:-criu-dir,criuz-lz4,criuz-lz4-stream}" --json "$out/cpus-$n.json"
    done
    ;;
  cold)
    # ABSORB gives criuz's dumps that budget (e.g. 768M).
    "${B[@]}" --cold --size "$size" --runs 1 --workloads "${WORKLOADS:-mixed,text}" \
      --configs "${CONFIGS:-criu-dir,criuz-lz4,criuz-zstd}" ${ABSORB:+--absorb "$ABSORB"} --json "$out/cold16.json"
    ;;
  lazy)
    "${B[@]}" --lazy --size "$size" --runs "${RUNS:-3}" --workloads mixed --json "$out/lazy16.json"
    ;;
  lazy-cold)
    "${B[@]}" --lazy --cold --size "$size" --runs 1 --workloads mixed --json "$out/lazy16-cold.json"
    ;;
  write-rate)
    # What one thread writing a file into the page cache keeps up with (as
    # criuz's archive writer does), then the sync: whether the backlog of a
    # 16-core dump of random memory waits for the page cache or the disk.
    f=/var/tmp/criuz-write-rate
    rm -f "$f" && sync
    dd if=/dev/zero of="$f" bs=256K count=16384 2>&1 | tail -1
    t=$(date +%s.%N)
    sync
    echo "sync after it: $(awk "BEGIN { print $(date +%s.%N) - $t }") s"
    rm -f "$f"
    # The same 4 GiB in 256 KiB writes: alone (0), with writeback started
    # every 8 MiB by a second thread as criuz's archive writer does
    # (io::EarlyWriteback) (1), and with that thread also flushing every
    # 32 MiB, as it does once CRIU is done (2, session 33):
    # whether either slows the writer, which on 16 cores drains random
    # memory's dump at about 1.9 GB/s (session 32) while its backlog holds
    # 1-2 GiB.
    for mode in 0 1 2 0 1 2; do
      python3 - "$f" "$mode" <<'PY'
import ctypes, os, sys, threading, time, queue
path, mode = sys.argv[1], int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
SYNC_FILE_RANGE_WRITE = 2
chunk, step, flush_step, total = os.urandom(256 << 10), 8 << 20, 32 << 20, 4 << 30
os.sync()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
ranges = queue.Queue()
def flusher():
    next_flush = flush_step
    while (r := ranges.get()) is not None:
        libc.sync_file_range(own, r[0], r[1], SYNC_FILE_RANGE_WRITE)
        if mode == 2 and r[0] + r[1] >= next_flush:
            os.fdatasync(own)
            next_flush = r[0] + r[1] + flush_step
th = threading.Thread(target=flusher)
th.start()
t0, written, started = time.monotonic(), 0, 0
while written < total:
    written += os.write(fd, chunk)
    if mode and written - started >= step:
        ranges.put((started, written - started))
        started = written
t1 = time.monotonic()
ranges.put(None)
th.join()
os.fsync(fd)
t2 = time.monotonic()
os.close(own)
os.close(fd)
os.unlink(path)
what = ["off", "on", "on, flushed every 32 MiB"][mode]
print(f"write-rate: early writeback {what}: written {t1 - t0:.2f} s ({total / (t1 - t0) / 1e9:.2f} GB/s), durable {t2 - t0:.2f} s")
PY
    done
    ;;
  gpu)
    # 4 GiB weights, 12 GiB KV cache (25% filled): a 21.7 GB host image.
    c=${2:?"gpu: which configuration (criu-dir, criuz-lz4, criuz-zstd)"}
    "${B[@]}" --gpu --configs "$c" --runs 1 --cold --json "$out/gpu-$c.json"
    ;;
  gpu-no-ids)
    # The same, criuz dumping with --no-ids: what the page ids a CUDA
    # tree stores by default cost and save.
    "${B[@]}" --gpu --gpu-no-ids --configs criuz-zstd --runs 1 --cold --json "$out/gpu-no-ids.json"
    ;;
  gpu-no-planes)
    # criuz-lz4 without byte planes: beside a `gpu criuz-lz4` run, what
    # the planes cost in dump CPU on this image.
    "${B[@]}" --gpu --gpu-no-planes --configs criuz-lz4 --runs 1 --cold --json "$out/gpu-no-planes.json"
    ;;
  planes-cpu)
    # The byte planes' CPU on this machine's cores, without the GPU app or
    # CRIU's share: PLANES_MIB (512) of the gpu-image stand-in dumped once
    # by CRIU, then packed into /dev/shm with page ids (as a CUDA dump
    # stores them), with and without planes, by worker count, in turn;
    # user, sys and wall seconds. Filling takes one core a while: 1 GiB did
    # not fill within session 32's 90 s cap there (on 2 cores here, about a
    # minute and a half).
    # CRIUZ names another build to compare, PLANES_JOBS the worker counts.
    d=/var/tmp/criuz-planes-cpu
    rm -rf "$d" && mkdir -p "$d/img" "$d/w"
    criuz-workload --dir "$d/w" --mib "${PLANES_MIB:-512}" --pattern gpu-image >"$d/w.log" 2>&1 &
    w=$!
    for _ in $(seq 240); do grep -q ready "$d/w.log" && break; sleep 0.5; done
    criu dump -t "$w" -D "$d/img" --shell-job -o dump.log
    { wait "$w"; } 2>/dev/null || true
    TIMEFORMAT='%U %S %R'
    for j in ${PLANES_JOBS:-16 8 4}; do
      for _ in 1 2 3; do
        for f in planes flat; do
          flat=()
          [[ $f == flat ]] && flat=(--no-planes)
          a=/dev/shm/criuz-planes-cpu.czr
          rm -f "$a"
          t=$({ time "${CRIUZ:-criuz}" pack --ids "${flat[@]}" -j "$j" -o "$a" "$d/img" >/dev/null 2>&1; } 2>&1)
          echo "planes-cpu: -j $j $f user/sys/wall $t bytes $(stat -c %s "$a")"
          rm -f "$a"
        done
      done
    done
    rm -rf "$d"
    ;;
  gpu-eager)
    # One run, criuz's archive restored eagerly only: criuz-lz4 (byte
    # planes) or criuz-lz4-flat (--no-planes). Alternated, these pairs give
    # the planes' dump CPU on the GPU image, and LZ4's own figures.
    c=${2:?"gpu-eager: criuz-lz4 or criuz-lz4-flat"}
    flat=()
    [[ $c == criuz-lz4-flat ]] && flat=(--gpu-no-planes)
    "${B[@]}" --gpu --gpu-eager-only "${flat[@]}" --configs criuz-lz4 --runs 1 --cold \
      --json "$out/gpu-eager-$c-$(date +%s%N).json"
    ;;
  gpu-runs)
    # Each run its own folder: a part's JSON is named by its configuration.
    for c in criuz-zstd criu-dir criuz-zstd criuz-lz4 criu-dir; do
      OUT=$out/runs/$c-$(date +%s%N) bash "$PWD/bench/device.sh" gpu "$c"
    done
    ;;
  session)
    # Most wanted first; each part gets at most its cap and what is left.
    end=$(($(date +%s) + ${BUDGET_S:-540}))
    me=$PWD/bench/device.sh
    part() {
      local cap=$1 left=$((end - $(date +%s)))
      shift
      if ((left < 30)); then
        echo "device: no time left for: $*"
        return 0
      fi
      timeout --kill-after=5 $((cap < left ? cap : left)) "$@" || echo "device: $* ended with status $?"
    }
    # Each part's JSON under parts/ (named by the part), all of it in one
    # archive at the end: what the device tool returns is a few files.
    export OUT=$out/parts
    # What CRIU's start costs depends on whether /run keeps its kernel probes.
    findmnt -n -o FSTYPE /run || true
    # Issue 33's 16-core table first, medians of 3: 4 GiB of each pattern,
    # durable dump, frozen time, warm restore and dump RSS, the default
    # codec against criu-dir (then sync, for random and elf). The pattern
    # workloads fill their memory on every core (session 40), which is
    # what lets three runs of each fit one call.
    part 400 bash "$me" table
    # Lazy: how soon the tree runs against a placed restore.
    # Its rounds (at least 3) each place, lazily restore and read 4 GiB after
    # warming 5 GiB of guest memory: session 81's 60 s cap was too short.
    RUNS=1 part 200 bash "$me" lazy
    # zstd beside the table, one run each.
    CONFIGS=criuz-zstd part 90 bash "$me" scale
    # Cold reads: criuz's read rate against a plain read of the same file.
    WORKLOADS=mixed CONFIGS=criu-dir,criuz-lz4 part 60 bash "$me" cold
    # Scaling, with what is left: 2 cores against all 16.
    for n in 2 16; do
      part 60 "${B[@]}" --cpus "$n" --size "$size" --runs 1 --workloads mixed --configs criuz-lz4 \
        --json "$OUT/cpus-$n.json"
    done
    tar -C "$out" -czf "$out/device.tgz" parts && rm -rf "$out/parts"
    ;;
  *)
    echo "usage: bench/device.sh scale|table|cpus|cold|lazy|lazy-cold|write-rate|gpu CONFIG|gpu-no-ids|gpu-no-planes|planes-cpu|gpu-eager CONFIG|gpu-runs|session" >&2
    exit 2
    ;;
esac
