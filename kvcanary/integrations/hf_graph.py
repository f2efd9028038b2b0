"""The device work of a step's before hook, captured once per batch shape and replayed (CUDA).

Eagerly, a forward's before hook issues some forty device calls (read-table gather, staging,
token-table append, plan, HEAD verify and write, the new tokens' read check), each costing the
host 10-40 us on the H200's host. All of them read only buffers whose addresses do not change
from one step to the next of the same shape: the engine's input storage, the builder's staged
buffer (one of a few taking turns), a read table per entry, and the canary's own buffers. So the
sequence is captured into a CUDA graph once a shape has run eagerly ``EAGER_SIGHTINGS`` times (the
first run compiles Triton kernels and warms the allocator) and replayed afterwards: one host call.

The key is everything the captured calls depend on: batch size, new tokens, token cells, the read
table's width rounded up (cells past a request's length are never read), which
staged buffer, and the data pointers of the engine's tensors. Anything else — a read index
shorter than the batch (an engine bug), the flash block-table path, a sliding-window group, the
token oracle, fault injection — runs eagerly.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kvcanary.runtime.streams import stream_cache

WIDTH_STEP = 512  # read-table columns: at least this, rounded up to a power of two (few shapes, little waste)
MAX_ENTRIES = 32  # captured shapes kept (each takes one of the staged buffers' turns)
# A shape is captured after this many eager runs (the first compiles Triton kernels and warms the
# allocator; a capture costs about one eager run more, each replay saves one).
EAGER_SIGHTINGS = 1


class _Entry:
    __slots__ = ("batch", "graph", "state", "keep")

    def __init__(self, batch):
        self.batch, self.graph, self.state, self.keep = batch, None, None, None


class StepGraphs:
    """Whole before-hook device work per batch shape: eager, then captured, then replayed.

    ``graph_type`` makes the graphs: ``torch.cuda.CUDAGraph`` on CUDA; tests pass the CPU stand-in
    ``kvcanary.runtime.graphs.DispatchGraph``.
    """

    def __init__(self, session, graph_type=None):
        self.s = session
        self.graph_type = graph_type or torch.cuda.CUDAGraph
        self.entries: OrderedDict = OrderedDict()
        self.seen: dict = {}  # eager runs per shape (without the staged buffer's turn)
        self.captures = self.replays = 0

    def usable(self, io) -> bool:
        c = self.s.canary
        return (not io.use_block_table and self.s.layout.swa_group is None and not self.s.builder.oracle
                and c.injector is None
                and not (c.device.type == "cuda" and torch.cuda.is_current_stream_capturing()))

    def before(self, h) -> object:
        """Build, check and launch the step's before-forward work; returns its ForwardBatch."""
        s, b, io = self.s, self.s.builder, h.io
        g = s.layout.full_group
        # a power of two from WIDTH_STEP, never past the canary's table (a wider batch fails its size check)
        width = max(h.width, min(max(WIDTH_STEP, 1 << (max(1, h.width) - 1).bit_length()), s.canary.max_context))
        shape = (h.bs, h.T, h.small, width, io.max_kv_read == 0, min(h.total, io.true_read_sizes[g]) == h.total,
                 io.input_ids.data_ptr(), io.position_ids.data_ptr(), io.read_index_storage[g].data_ptr(),
                 io.write_index_storage.data_ptr())
        key = shape + (h.packed.data_ptr(),)
        e = self.entries.get(key)
        if e is None:
            e = _Entry(b.assemble(h, width))
            self.entries[key] = e
            while len(self.entries) > MAX_ENTRIES:
                self.entries.popitem(last=False)  # its graph and the buffers it writes go together
        else:
            self.entries.move_to_end(key)
        batch, c = e.batch, s.canary
        c.host_before(batch)  # checks, drains, opens the forward; joins the side stream's earlier work
        launcher = c.launcher
        side = launcher.streams.side()
        if side is None:
            self._run(e, shape, h)
            return batch
        streams = stream_cache(c.device)
        # the side stream starts after the engine prepared this step's inputs (they are read below)
        side.wait_event(launcher.streams.record(streams.current()))
        with streams.use(side):
            self._run(e, shape, h)
        # HEAD runs beside the forward; the step's close makes the engine stream wait for it
        launcher.pending = launcher.streams.record(side)
        return batch

    def _run(self, e: _Entry, shape: tuple, h) -> None:
        launcher = self.s.canary.launcher
        if e.graph is not None:
            e.graph.replay()
            launcher.restore(e.state)
            self.replays += 1
        elif self.seen.get(shape, 0) >= EAGER_SIGHTINGS:
            graph = self.graph_type()
            # thread-local: the engine's other threads may keep issuing CUDA calls meanwhile
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._body(e, h)
            finally:
                graph.capture_end()
            e.graph, e.state = graph, launcher.state()
            graph.replay()  # a capture records the calls without running them
            self.captures += 1
        else:
            self.seen[shape] = self.seen.get(shape, 0) + 1
            self._body(e, h)

    def _body(self, e: _Entry, h) -> None:
        s, batch = self.s, e.batch
        # A graph keeps no tensor alive: the entry holds what the body reads that the builder may replace.
        e.keep = s.builder.iota
        s.builder.fill_read_table(batch, h)
        s.canary.device_before(batch)
        s.builder.verify_new_reads(batch, shortcut=False)
