"""The memory watch of the recorded stream models (``tests/memory_watch.py``): it must list each unordered
conflict it exists for, and nothing once an event, a host sync or ``record_stream`` orders it."""

import pytest
import torch

from kvcanary.runtime.streams import RecordingStreams


@pytest.fixture
def watched(monkeypatch):
    from memory_watch import watch_memory

    rec = RecordingStreams(("engine", "canary", "h2d"))
    with watch_memory(monkeypatch, rec) as watch:
        yield rec, watch


def test_a_write_and_a_read_on_two_streams_race_unless_an_event_orders_them(watched):
    rec, watch = watched
    found = []
    for ordered in (False, True):
        made = torch.zeros(8, dtype=torch.int64)
        made.add_(1)  # (on the engine stream: a write)
        if ordered:
            rec.wait(rec.streams["canary"], rec.record(rec.streams["engine"]))
        with rec.use(rec.streams["canary"]):
            made.sum()  # a read
            made[:4].view(2, 2)  # (views access nothing)
        found.append(watch.races())
        watch.storages.restart()
    assert found == [[("zeros.default (64 bytes)", "add_.Tensor@engine", "sum.default@canary")], []]


def test_the_host_refilling_a_buffer_a_queued_copy_reads_races_unless_the_host_waited(watched):
    rec, watch = watched
    found = []
    for synced in (False, True):
        host, device = torch.zeros(4), torch.zeros(4)
        watch.host(host, label="pinned")
        watch.device(device, label="device")
        with rec.use(rec.streams["h2d"]):
            device.copy_(host)  # (a host-to-device copy: queued on the stream, it reads the host buffer later)
        if synced:
            rec.synchronize(rec.streams["h2d"])
        host.fill_(2.0)  # the host's refill (host memory only: at the host's time)
        found.append(watch.races())
        watch.storages.restart()
    assert found == [[("pinned", "copy_.default@h2d", "fill_.Scalar@host")], []]


def test_a_triton_launch_writes_what_it_changed(watched):
    from kvcanary.ops import triton_ops

    rec, watch = watched
    src, dst = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    watch.device(src, label="src")
    watch.device(dst, label="dst")

    class Kernel:  # (a stand-in kernel: copies src into dst)
        __name__ = "kernel"

        def __getitem__(self, grid):
            return lambda **kw: kw["dst"].copy_(kw["src"])

    kernel = Kernel()

    with rec.use(rec.streams["canary"]):
        triton_ops._launch(kernel, (1,), src=src, dst=dst)
    dst.sum(), src.add_(1)  # (the engine stream: a read of what it wrote, a write of what it read)
    assert watch.races() == [("dst", "kernel@canary", "sum.default@engine"), ("src", "kernel@canary", "add_.Tensor@engine")]


def test_memory_freed_under_another_streams_use_is_listed_unless_handed_over(watched):
    # CUDA's caching allocator gives a freed tensor's memory to the next allocation on the stream that made it;
    # a use on another stream must be ordered before the free, or named by record_stream
    from hf_async_model import restart

    rec, watch = watched
    engine, canary = rec.streams["engine"], rec.streams["canary"]
    found = []
    for fix in ("none", "wait", "record_stream"):
        restart(rec)
        made = torch.arange(8)  # (on the engine stream)
        with rec.use(canary):
            made.add(1)
        if fix == "wait":
            rec.wait(engine, rec.record(canary))
        elif fix == "record_stream":
            watch.allocator.recorded(made, "canary")
        del made
        torch.zeros(1)  # (the engine stream's next allocation)
        found.append(sorted((a.op.split(" ")[0], b.op.split(" ")[0]) for a, b, _ in rec.races()))
    assert found == [[("use:add.Tensor", "free")], [], []]
