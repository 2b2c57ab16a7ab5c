# criuz-bench --gpu: a stand-in for an inference server that has loaded its
# model: bf16 "weights" and a bf16 "KV cache" on the GPU (a share of it
# filled), and some host state. On SIGUSR1 it answers with a digest of a
# forward pass, of the cache and of the host state, written to DIR/sum.N
# (N counts the requests): equal digests before a dump and after a restore
# mean the GPU state came back.
#
# Environment: W_GIB (weights, GiB), KV_GIB (cache, GiB), KV_FILL (its filled
# share). Writes DIR/ready (its pid) and DIR/sum.0 once loaded.
import hashlib
import os
import signal
import sys
import time

import torch

out = sys.argv[1]
weights_gib = float(os.environ.get("W_GIB", "1"))
kv_gib = float(os.environ.get("KV_GIB", "2"))
kv_fill = float(os.environ.get("KV_FILL", "0.25"))

torch.manual_seed(1234)
side = 4096
layer_bytes = side * side * 2
layers = [
    torch.randn(side, side, device="cuda", dtype=torch.bfloat16) * 0.02
    for _ in range(max(1, int(weights_gib * (1 << 30)) // layer_bytes))
]
cache = torch.zeros(int(kv_gib * (1 << 30)) // 2, device="cuda", dtype=torch.bfloat16)
used = int(cache.numel() * kv_fill)
cache[:used] = torch.randn(used, device="cuda", dtype=torch.bfloat16)
prompt = torch.randn(32, side, device="cuda", dtype=torch.bfloat16)
host_state = bytearray(os.urandom(1 << 20)) * 32


def answer():
    h = hashlib.sha256()
    x = prompt
    for w in layers:
        x = torch.tanh(x @ w)
    h.update(x.float().cpu().numpy().tobytes())
    step = 1 << 27
    for i in range(0, cache.numel(), step):
        h.update(cache[i : i + step].float().sum().cpu().numpy().tobytes())
    h.update(hashlib.sha256(host_state).digest())
    return h.hexdigest()[:20]


def write(name, text):
    tmp = os.path.join(out, "." + name)
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(out, name))


asked = [0]
signal.signal(signal.SIGUSR1, lambda *_: asked.__setitem__(0, asked[0] + 1))
write("sum.0", answer())
write("ready", str(os.getpid()))
done = 0
while True:
    time.sleep(0.02)
    while done < asked[0]:
        done += 1
        write(f"sum.{done}", answer())
