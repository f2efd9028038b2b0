"""Host cost of one CUDA graph replay (H200): against the graph's node count, with host-memory copies
inside, on a stream that waits for a busy one, and with the host's caches cold (as inside an engine's
step). Prints the median and 10th percentile microseconds of the replay call alone.

    python benchmarks/graph_launch.py
    python benchmarks/graph_launch.py --waits   # a fused step's ordering: eager waits against in-graph waits

``--waits``: the host cost of ordering a 40-node graph on a side stream after two other streams (the
inputs' and the compute stream), as a fused steady step does: two event records and two waits from the
host then the replay, against two records and the replay of a graph whose first nodes wait for those
(external) events; the two alternate step by step, idle, behind queued work and with cold caches.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary.runtime.streams import event_wait, record_event  # noqa: E402


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


def build(n, copies=False, side=None, waits=()):
    """A graph of ``n`` small kernels captured on ``side`` (a new stream by default); ``copies``: a pinned
    host-to-device copy before them and one back after; ``waits``: external events its first nodes wait for."""
    x = torch.zeros(64, device="cuda", dtype=torch.int64)
    pin_in = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    pin_out = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    s = side or torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1)
        for ev in waits:
            ev.record(s)  # (an event exists once recorded)
        torch.cuda.synchronize()
        g.capture_begin()
        for ev in waits:
            event_wait(ev, s)
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


def ordered_steps(n=40, steps=400):
    """Median / p10 host microseconds of the eager-wait and in-graph-wait sequences, alternating."""
    cold = list(range(4_000_000))
    here, compute, side = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    waits = (torch.cuda.Event(external=True), torch.cuda.Event(external=True))
    plain, waiting = build(n, side=side), build(n, side=side, waits=waits)
    own = (torch.cuda.Event(), torch.cuda.Event())
    for label, busy, cool in (("idle", False, False), ("busy", True, False), ("idle, cold host", False, True),
                              ("busy, cold host", True, True)):
        ts = {"eager waits": [], "in-graph waits": []}
        for i in range(steps):
            kind = "eager waits" if i % 2 == 0 else "in-graph waits"
            torch.cuda.synchronize()
            if busy:
                with torch.cuda.stream(compute):
                    torch.cuda._sleep(2_000_000)
            if cool:
                sum(cold)
            t0 = time.perf_counter()
            if kind == "eager waits":
                record_event(own[0], here)
                event_wait(own[0], side)
                record_event(own[1], compute)
                event_wait(own[1], side)
                torch.cuda.set_stream(side)
                plain.replay()
            else:
                record_event(waits[0], here)
                record_event(waits[1], compute)
                torch.cuda.set_stream(side)
                waiting.replay()
            torch.cuda.set_stream(here)
            ts[kind].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        report(label, ts)


def report(label: str, ts: dict, what: str = "") -> None:
    """Median and 10th percentile of each kind's times (the first ten, warming up, left out)."""
    for kind, t in ts.items():
        t = t[10:]
        print(f"{label:16s} {kind:15s}: median {statistics.median(t) * 1e6:6.1f} us, "
              f"p10 {sorted(t)[len(t) // 10] * 1e6:6.1f} us{what}", flush=True)


def main():
    if "--waits" in sys.argv[1:]:
        ordered_steps()
        return
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
