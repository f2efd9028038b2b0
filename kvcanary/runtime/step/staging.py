"""The staging of a step's host part (``runtime.engine.HostStep``, which a source's ``host_part`` sends
through ``Staging``: one pinned buffer, one asynchronous copy into a device buffer whose views become the
batch's tensors).
"""

from __future__ import annotations

import torch

from kvcanary.runtime.monitor import KEEP_BATCHES
from kvcanary.runtime.observer import NUM_SLOTS
from kvcanary.runtime.streams import capturing, event_synchronize, record_event, stream_cache

__all__ = ["Staging", "STAGING_TURNS"]

# Staging turns: a remembered batch's buffer is not refilled for KEEP_BATCHES steps (and a spare),
# rounded up to a multiple of the snapshot slots, so a steady step's (turn, slot) pair comes back every
# STAGING_TURNS steps (a fused graph per pair: fused.py)
STAGING_TURNS = -(-(KEEP_BATCHES + 1) // NUM_SLOTS) * NUM_SLOTS


class Staging:
    """The step's small host arrays in one pinned buffer per turn and one asynchronous copy into the
    turn's device buffer (pageable copies would block the host on every step).

    Device buffers take turns over ``depth`` steps: a batch's tensors are views into one of them, and
    the monitor reads a remembered batch when its violations arrive steps later (reader attribution),
    so a buffer must not be refilled while that batch may still be read: ``KEEP_BATCHES`` turns and
    a spare, rounded up to a multiple of the snapshot slots (``STAGING_TURNS``; few turns also mean few
    CUDA-graph captures, ``graphs.py``). Each turn has its own
    pinned buffer too, so a step graph per turn can hold the copy itself (``copy`` inside a capture:
    it replays from the same host address), and the host never refills a pinned buffer whose copy
    may still be in flight (the turn's event). On the CPU the values go straight into the turn's buffer
    (one turn, ``depth=1``, where the canary reads each step's observation when the step closes).
    """

    def __init__(self, device: torch.device, depth: int = STAGING_TURNS):
        self.device, self.cuda, self.depth = device, device.type == "cuda", depth
        self.size = 0
        # the buffers' first size, at least (``sized_for``): a step's values within it never outgrow them
        self.size_hint = 0
        self.host: list[torch.Tensor] = []  # CUDA: the pinned buffer of each turn
        self.ring: list[torch.Tensor] = []
        self.views: dict = {}  # (turn, size) -> the device slice, the pinned slice, the numpy destination
        self.static: torch.Tensor | None = None  # the one buffer a captured multi-token step reads (graphs.py)
        self.turn = 0
        self.events = [torch.cuda.Event() for _ in range(depth)] if self.cuda else []
        # or, per turn, a later point its copy is known to precede (copied's fence): no CUDA call to check it
        self.fences: list = [None] * depth
        self.stream = stream_cache(device) if self.cuda else None
        self.pending: tuple | None = None  # (device slice, pinned slice, turn) filled but not yet copied
        self.last_ptr = 0  # the data pointer of the last send's device buffer (a graph key's part)
        # called with the device buffers each time they are made: the runner hands them to the side stream,
        # which reads them (an outgrown buffer's memory then serves no new tensor while that stream may use it)
        self.on_alloc = None

    def send(self, parts: list, copy: bool = True, last: int | None = None) -> tuple[torch.Tensor, int]:
        """``parts`` (lists of ints or int64 arrays; or one int64 memoryview of all the values) back to back in
        one device buffer; returns the buffer and where the last part starts (``last``: the length of the
        last part, when the caller passes it joined to the others). ``copy=False``: the host-to-device copy
        waits for ``copy()`` (issued eagerly, or inside a captured step)."""
        n = len(parts[0]) if len(parts) == 1 else sum(map(len, parts))
        turn = self.turn
        if self.cuda:  # this turn's last copy has long finished; never overwrite it in flight
            fence = self.fences[turn]
            if fence is None:
                event_synchronize(self.events[turn])
            else:
                fence.wait()
        if self.size < n:
            self.size = max(n, 2 * self.size, 1024, self.size_hint)
            if self.cuda:
                self.host = [torch.empty(self.size, dtype=torch.int64, pin_memory=True) for _ in range(self.depth)]
            # (remembered batches keep their old buffers alive)
            self.ring = [torch.empty(self.size, dtype=torch.int64, device=self.device) for _ in range(self.depth)]
            self.views = {}
            self.static = torch.empty(self.size, dtype=torch.int64, device=self.device)
            if self.on_alloc is not None:
                self.on_alloc(*self.ring, self.static)
        views = self.views.get((turn, n))
        if views is None:
            if len(self.views) > 256:  # sizes come and go (prefill chunks): never grow without bound
                self.views.clear()
            out = self.ring[turn][:n]
            host = self.host[turn][:n] if self.cuda else None
            dst = host.numpy() if self.cuda else out.numpy()
            views = self.views[turn, n] = (out, host, dst, out.data_ptr(), memoryview(dst).cast("B").cast("q"))
        out, host, dst, self.last_ptr, words = views  # slices made once per (turn, size): each costs a tensor call
        self.turn = (turn + 1) % self.depth
        if type(parts[0]) is memoryview:  # (a steady step's kept values: a plain copy, no numpy call)
            words[:] = parts[0]
        else:
            at = 0
            for p in parts:
                dst[at:at + len(p)] = p  # numpy converts a list of ints several times faster than torch
                at += len(p)
        if self.cuda:
            self.pending = (out, host, turn)
            if copy:
                self.copy()
        return out, n - (len(parts[-1]) if last is None else last)

    def sized_for(self, max_batch: int, max_tokens: int) -> None:
        """Make the first buffers hold any step of at most ``max_batch`` requests (padding included) and
        ``max_tokens`` new tokens whose token cells are its new positions (``host_part``: 4 values per request, a
        valid length per request and 3 per cell, a batch index per token; a padded decode step's padding requests
        take a cell each, so 9 per request bounds it). Grown on demand instead, a prefill's chunks grew them
        several times a session (transformers makes one per call), each time a pinned and a device buffer per
        turn inside a step, where the engine's emptied allocator cache makes them ``cudaMalloc`` calls. A step
        that sends a cached prefix's tokens may still outgrow them."""
        self.size_hint = 9 * max_batch + 4 * max_tokens

    def copy(self) -> None:
        """Issue the last ``send``'s host-to-device copy on the current stream (a no-op once issued, and
        on the CPU). Inside a capture it is recorded with the pinned buffer's address."""
        if self.pending is None:
            return
        out, host, turn = self.pending
        out.copy_(host, non_blocking=True)
        if not capturing():
            self.copied()

    def copied(self, fence=None) -> None:
        """The copy was issued on the current stream (eagerly, or by a graph's replay): its turn's event.
        ``fence``: a point recorded on the same stream after the copy (``observer.SlotFence``), which stands
        for the event (one CUDA call fewer per step, and none when the turn comes round if it is known
        complete by then)."""
        if self.pending is not None:
            turn = self.pending[2]
            if fence is None:
                record_event(self.events[turn], self.stream.current())
            self.fences[turn] = fence
            self.pending = None

    def to_static(self, packed: torch.Tensor) -> torch.Tensor:
        """A copy of this step's staged values in the one buffer whose address never changes (while the
        buffers do not grow): what a captured multi-token step reads, whichever turn the values arrived in.
        The current stream must follow every earlier reader of that buffer (``StepGraphs._general``)."""
        self.copy()
        out = self.static[:packed.shape[0]]
        out.copy_(packed)
        return out
