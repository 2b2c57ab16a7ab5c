"""criuz bench: a Python process holding large dicts and lists.

Usage: python3 bench_app.py DIR MIB

Builds about MIB MiB of live objects (dicts of records: tuples of ints,
strings, floats and small lists), writes DIR/ready with its pid, then polls for
DIR/request. For each request it hashes every record (marshal, chunk by chunk)
and writes DIR/answer: "nonce=N entries=N sum=HEX". The bench compares the
answer before the checkpoint with the answer of the restored process. A
request "rewrite P N" instead replaces P% of the records with new ones (as a
service updating records does) and answers "nonce=N rewrote=K".
"""

import hashlib
import marshal
import os
import sys
import time

# Measured bytes of memory per record (key, tuple, values, dict slot).
BYTES_PER_RECORD = 470
CHUNK = 10000
WORDS = ["checkpoint", "restore", "process", "memory", "kernel", "image", "socket", "container",
         "thread", "signal", "buffer", "server", "request", "latency", "snapshot", "migration"]


def build(mib):
    n = max(1000, (mib << 20) // BYTES_PER_RECORD)
    chunks = []
    for start in range(0, n, CHUNK):
        chunk = {}
        for i in range(start, min(n, start + CHUNK)):
            h = (i * 2654435761) & 0xFFFFFFFF
            chunk["user:%09d" % i] = (
                i,
                "%s-%08x" % (WORDS[h & 15], h),
                (h % 100000) / 100.0,
                [h % 997, h % 991, i % 983],
            )
        chunks.append(chunk)
    return n, chunks


def rewrite(n, chunks, percent, generation):
    stride = max(1.0, 100.0 / min(100.0, max(0.001, percent)))
    x, k = 0.0, 0
    while int(x) < n:
        i = int(x)
        c = chunks[i // CHUNK]
        key = "user:%09d" % i
        old = c[key]
        h = (i * 2654435761 + generation * 40503) & 0xFFFFFFFF
        c[key] = (old[0], "%s-%08x" % (WORDS[h & 15], h), (h % 100000) / 100.0, [h % 997, h % 991, generation])
        x += stride
        k += 1
    return k


def checksum(n, chunks):
    h = hashlib.blake2b(digest_size=16)
    for c in chunks:
        h.update(marshal.dumps(c))
    return "entries=%d chunks=%d sum=%s" % (n, len(chunks), h.hexdigest())


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def main():
    d, mib = sys.argv[1], int(sys.argv[2])
    n, chunks = build(mib)
    write_atomic(os.path.join(d, "ready"), "%d\n" % os.getpid())
    request = os.path.join(d, "request")
    answer = os.path.join(d, "answer")
    while True:
        if os.path.exists(request):
            with open(request) as f:
                req = f.read().strip()
            os.unlink(request)
            if req.startswith("rewrite "):
                _, percent, nonce = req.split()
                generation = int(nonce)
                k = rewrite(n, chunks, float(percent), generation)
                write_atomic(answer, "nonce=%s rewrote=%d\n" % (nonce, k))
            else:
                write_atomic(answer, "nonce=%s %s\n" % (req, checksum(n, chunks)))
        time.sleep(0.02)


if __name__ == "__main__":
    main()
