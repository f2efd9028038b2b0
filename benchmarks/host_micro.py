"""Host cost of the CUDA calls the canary's hot path makes (a development tool)."""
import time, torch, os
from kvcanary import ops
from kvcanary.ops import triton_ops as T

def t(name, fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    print(f"{name:48s} {dt*1e6:8.2f} us")

dev = torch.device("cuda")
from triton import knobs
print("launch_enter_hook", knobs.runtime.launch_enter_hook, "fast", T._Launcher.enabled)
s = torch.cuda.Stream()
ev = torch.cuda.Event()
x = torch.arange(4096, device=dev)
idx = torch.arange(64, device=dev)
t("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
t("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
t("_cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
t("torch.cuda.current_device()", lambda: torch.cuda.current_device())
def ctx():
    with torch.cuda.stream(s): pass
t("with torch.cuda.stream(s)", ctx)
def setget():
    prev = torch.cuda.current_stream(); torch.cuda.set_stream(s); torch.cuda.set_stream(prev)
t("set_stream pair", setget)
t("event.record(s)", lambda: ev.record(s))
t("stream.wait_event", lambda: s.wait_event(ev))
t("is_current_stream_capturing", torch.cuda.is_current_stream_capturing)
t("x.index_select", lambda: x.index_select(0, idx))
t("x[:64].copy_(x[64:128])", lambda: x[:64].copy_(x[64:128]))
t("torch.add", lambda: torch.add(x, 1))
t("x[:64] slice", lambda: x[:64])
pin = torch.empty(1024, dtype=torch.int64, pin_memory=True)
d = torch.empty(1024, dtype=torch.int64, device=dev)
t("H2D non_blocking 1024", lambda: d.copy_(pin, non_blocking=True))
g = torch.cuda.CUDAGraph()
y = torch.zeros(64, device=dev)
with torch.cuda.stream(s):
    s.wait_stream(torch.cuda.current_stream())
    g.capture_begin()
    for _ in range(10): y.add_(1)
    g.capture_end()
t("CUDAGraph.replay (10 kernels)", g.replay)
# a real canary op: verify through the fast launcher and through triton's own path
buf = ops.allocate_canary_buffer(1 << 16, 32, dev)
ent = ops.Entries.allocate(1024, dev)
ring = ops.ViolationRing.allocate(256, dev)
cnt = ops.allocate_counters(dev)
kw = dict(buf=buf, entries=ent, ring=ring, counters=cnt, launch_tag=0)
t("triton verify (fast launcher)", lambda: T.verify(**kw))
T._Launcher.enabled = False
T._launchers.clear()
t("triton verify (triton's launch)", lambda: T.verify(**kw))
T._Launcher.enabled = True
t("triton verify (fast launcher again)", lambda: T.verify(**kw))
print("launcher cache sizes", {f.__name__ if hasattr(f,'__name__') else str(f): len(l.cache) for f, l in T._launchers.items()})
