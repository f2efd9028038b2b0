"""Host cost of one CUDA graph replay (H200): against the graph's node count, with host-memory copies
inside, on a stream that waits for a busy one, and with the host's caches cold (as inside an engine's
step). Prints the median and 10th percentile microseconds of the replay call alone.

    python benchmarks/graph_launch.py
"""

import statistics
import time

import torch


def timed(g, busy=False, wait_on=None, cold=None, n=300):
    ts = []
    side = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    for _ in range(n):
        torch.cuda.synchronize()
        if busy:
            with torch.cuda.stream(wait_on or side):
                torch.cuda._sleep(2_000_000)  # about 1 ms of device work queued ahead
        if wait_on is not None:
            ev.record(wait_on)
            side.wait_event(ev)
        if cold is not None:
            sum(cold)  # walk a large list: the host's caches hold other data, as after an engine's Python
        t0 = time.perf_counter()
        g.replay()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6, sorted(ts)[n // 10] * 1e6


def build(n, copies=False):
    x = torch.zeros(64, device="cuda", dtype=torch.int64)
    pin_in = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    pin_out = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1)
        torch.cuda.synchronize()
        g.capture_begin()
        if copies:
            x.copy_(pin_in, non_blocking=True)
        for _ in range(n):
            x.add_(1)
        if copies:
            pin_out.copy_(x, non_blocking=True)
        g.capture_end()
    torch.cuda.synchronize()
    g.keep = (x, pin_in, pin_out)
    return g


def main():
    cold = list(range(4_000_000))
    other = torch.cuda.Stream()
    for n in (1, 10, 40, 80):
        for copies in (False, True):
            g = build(n, copies)
            for label, kw in (("idle", {}), ("busy", {"busy": True}), ("after busy stream", {"busy": True, "wait_on": other}),
                              ("idle, cold host", {"cold": cold}), ("busy, cold host", {"busy": True, "cold": cold})):
                med, p10 = timed(g, **kw)
                print(f"nodes {n:3d} copies {copies!s:5s} {label:18s}: median {med:6.1f} us, p10 {p10:6.1f} us",
                      flush=True)


if __name__ == "__main__":
    main()
