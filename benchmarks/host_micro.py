"""Host cost of the CUDA calls the canary's hot path makes: stream queries and switches, events, small
torch ops, a Triton launch through the canary's direct path and through Triton's own, and a CUDA-graph
replay. A development tool (docs/transformers.md, "Host cost", quotes its H200 figures).

    python benchmarks/host_micro.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary import ops  # noqa: E402
from kvcanary.ops import triton_ops  # noqa: E402


def timed(name: str, fn, n: int = 2000) -> None:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    per = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    print(f"{name:44s} {per * 1e6:8.2f} us")


def main() -> None:
    dev = torch.device("cuda")
    side, event = torch.cuda.Stream(), torch.cuda.Event()
    x, idx = torch.arange(4096, device=dev), torch.arange(64, device=dev)
    timed("torch.cuda.current_stream()", torch.cuda.current_stream)
    timed("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))

    def switch():
        with torch.cuda.stream(side):
            pass

    timed("with torch.cuda.stream(side)", switch)
    timed("event.record(side)", lambda: event.record(side))
    timed("side.wait_event(event)", lambda: side.wait_event(event))
    timed("x.index_select(0, idx)", lambda: x.index_select(0, idx))
    timed("x[:64].copy_(x[64:128])", lambda: x[:64].copy_(x[64:128]))
    pinned = torch.empty(1024, dtype=torch.int64, pin_memory=True)
    dst = torch.empty(1024, dtype=torch.int64, device=dev)
    timed("H2D copy of 1024 int64 (pinned)", lambda: dst.copy_(pinned, non_blocking=True))
    graph, y = torch.cuda.CUDAGraph(), torch.zeros(64, device=dev)
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        graph.capture_begin()
        for _ in range(10):
            y.add_(1)
        graph.capture_end()
    timed("CUDAGraph.replay() (10 kernels)", graph.replay)
    kw = dict(buf=ops.allocate_canary_buffer(1 << 16, 32, dev), entries=ops.Entries.allocate(1024, dev),
              ring=ops.ViolationRing.allocate(256, dev), counters=ops.allocate_counters(dev), launch_tag=0)
    timed("Triton verify, direct launch", lambda: triton_ops.verify(**kw))
    triton_ops._Launcher.enabled = False
    timed("Triton verify, Triton's launch", lambda: triton_ops.verify(**kw))
    triton_ops._Launcher.enabled = True
    probe_pinned_capture(dev, side)


def probe_pinned_capture(dev, side) -> None:
    """Can a CUDA graph hold the copies from and to pinned host memory (the staged values in, the step's
    snapshot out)? Captures both, changes the host buffer, replays, and checks what arrived."""
    src = torch.arange(256, dtype=torch.int64).pin_memory()
    dev_buf = torch.zeros(256, dtype=torch.int64, device=dev)
    out = torch.zeros(256, dtype=torch.int64).pin_memory()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            graph.capture_begin()
            dev_buf.copy_(src, non_blocking=True)
            dev_buf.mul_(2)
            out.copy_(dev_buf, non_blocking=True)
            graph.capture_end()
        src.copy_(torch.arange(256, dtype=torch.int64) + 7)
        graph.replay()
        torch.cuda.synchronize()
        ok = torch.equal(out, (torch.arange(256) + 7) * 2)
        print(f"{'pinned H2D + D2H inside a CUDA graph':44s} {'ok' if ok else 'WRONG VALUES'}")
        timed("CUDAGraph.replay() (H2D, kernel, D2H)", graph.replay)
    except Exception as e:  # noqa: BLE001 (a probe: report what failed)
        print(f"{'pinned H2D + D2H inside a CUDA graph':44s} failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
