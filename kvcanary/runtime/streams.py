"""Where the canary's device work runs, and what orders it against the engine's.

The engine's forward never reads canary records, so the canary's verify and write launches can run
on a side stream: the HEAD pair beside the forward, the TAIL pair (and the step's snapshot) after it,
while the host prepares the next forward. Events order the two streams:

- the side stream waits for the engine stream once the plan is built (HEAD reads the plan and the
  staged inputs), and again once the forward is launched (TAIL hashes the KV it wrote);
- the engine stream waits for the side stream when a step closes, so the next plan, staging and
  every later KV write (next forward, fork copies, reloads into freed slots) happen after TAIL read them.

Three layers share that interface. ``InlineStreams`` runs everything on the caller's stream (CPU,
and while the engine captures a CUDA graph). ``CudaStreams`` uses a real side stream and events.
``RecordingStreams`` is a CPU fake that runs work at once but records, per launch, the stream, the
resources read and written, and the event edges; ``races()`` then lists every pair of conflicting
accesses on different streams that no chain of events and host syncs orders (a vector-clock check).
"""

from __future__ import annotations

import bisect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch


# torch.cuda.is_current_stream_capturing without its Python wrapper (asked a few times per forward)
capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


# Event record / wait / query / synchronize without torch's Python wrappers (a few calls per forward
# each, and a Python call costs the host more than the call itself inside a step): the C methods where
# torch has them. ``event_wait(event, stream)``: work issued to ``stream`` from now on waits for the event.
_base = getattr(torch._C, "_CudaEventBase", None)
record_event = getattr(_base, "record", None) or (lambda event, stream: event.record(stream))
event_wait = getattr(_base, "wait", None) or (lambda event, stream: stream.wait_event(event))
event_query = getattr(_base, "query", None) or (lambda event: event.query())
event_synchronize = getattr(_base, "synchronize", None) or (lambda event: event.synchronize())


class InlineStreams:
    """Everything on the caller's current stream: no side stream, no events."""

    overlap = False

    def side(self):
        return None

    def current(self):
        return None

    def event(self):
        return None

    def record(self, stream):
        return None

    def wait(self, stream, event) -> None:
        pass

    def use(self, stream):
        return nullcontext()

    def same(self, a, b) -> bool:
        """Whether two streams of this layer are one stream."""
        return a is b

    def note(self, op: str, reads=(), writes=(), atomic=()) -> None:
        pass

    def synchronize(self, stream=None) -> None:
        pass


class _StreamCache:
    """The current CUDA stream as a ``torch.cuda.Stream``, found by its raw handle.

    ``torch.cuda.current_stream`` and the ``torch.cuda.stream`` context build Python objects and look
    up the device on every call (several microseconds each, several calls per forward); the raw
    handle is one C call, and the streams the canary meets are few and long-lived.
    """

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.by_handle: dict[int, torch.cuda.Stream] = {}
        self._raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._set = getattr(torch._C, "_cuda_setStream", None)

    def current(self) -> torch.cuda.Stream:
        if self._raw is None:
            return torch.cuda.current_stream(self.index)
        handle = self._raw(self.index)
        s = self.by_handle.get(handle)
        if s is None:
            s = torch.cuda.current_stream(self.index)
            if len(self.by_handle) < 64:  # an engine making a stream per step must not grow this forever
                self.by_handle[s.cuda_stream] = s
        return s

    def set(self, stream: torch.cuda.Stream) -> None:
        if self._set is None:
            torch.cuda.set_stream(stream)
        else:
            self._set(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)

    def use(self, stream: torch.cuda.Stream) -> "_Switch":
        """A context that makes ``stream`` current and restores the previous one (a no-op when it
        already is)."""
        return _Switch(self, stream)


class _Switch:
    """``_StreamCache.use``: a plain class (a generator-based context costs the host more per step),
    comparing raw handles (``Stream.__eq__`` is Python)."""

    __slots__ = ("cache", "stream", "prev")

    def __init__(self, cache: _StreamCache, stream: torch.cuda.Stream):
        self.cache, self.stream, self.prev = cache, stream, None

    def __enter__(self) -> None:
        prev = self.cache.current()
        if prev.cuda_stream != self.stream.cuda_stream:
            self.prev = prev
            self.cache.set(self.stream)

    def __exit__(self, *exc) -> bool:
        if self.prev is not None:
            self.cache.set(self.prev)
            self.prev = None
        return False


_caches: dict[int, _StreamCache] = {}


def stream_cache(device: torch.device) -> _StreamCache:
    """The process's stream cache for a CUDA device (one per device index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    c = _caches.get(index)
    if c is None:
        c = _caches[index] = _StreamCache(torch.device("cuda", index))
    return c


class CudaStreams(InlineStreams):
    """A real side stream and events on a CUDA device; inline while the current stream captures a graph."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = torch.cuda.Stream(device=device)
        self._cache = stream_cache(device)
        # One event per stream, re-recorded: a wait is enqueued with the event's state at the call, and a
        # later record on the same stream only marks a later point of it (a stronger wait, never a weaker one).
        self._events: dict[int, torch.cuda.Event] = {}

    @property
    def overlap(self) -> bool:
        # Waiting on an event recorded outside a capture is not capturable: a sequence captured on another
        # stream stays serial. A capture on the side stream itself (a whole step's work, replayed there)
        # keeps the overlap's staging: its launches already run on the side stream.
        if not capturing():
            return True
        return self.current() == self._side

    def side(self):
        return self._side

    def current(self):
        return self._cache.current()

    def record(self, stream):
        ev = self._events.get(stream.cuda_stream)
        if ev is None:
            ev = self._events[stream.cuda_stream] = torch.cuda.Event()
        record_event(ev, stream)
        return ev

    def wait(self, stream, event) -> None:
        if event is not None:
            event_wait(event, stream)

    def use(self, stream):
        return self._cache.use(stream)

    def same(self, a, b) -> bool:
        return a.cuda_stream == b.cuda_stream  # (Stream objects for one stream may differ)

    def synchronize(self, stream=None) -> None:
        (stream or self.current()).synchronize()


@dataclass
class Access:
    index: int  # issue order on the host
    stream: str
    op: str
    clock: dict  # the stream's vector clock at issue (own component included)
    reads: frozenset = field(default_factory=frozenset)
    writes: frozenset = field(default_factory=frozenset)
    atomic: frozenset = field(default_factory=frozenset)  # commutative updates (ring appends, counters)


class _FakeStream:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class RecordingStreams(InlineStreams):
    """CPU fake of ``CudaStreams``: work runs at once; launches, events and syncs are recorded.

    Streams are named (``engine`` and ``canary``, the side stream, and any more the caller names, such
    as an engine's own compute stream); ``engine`` is current at start. A launch on stream s gets s's vector clock
    (s's own count + 1); ``record`` snapshots a clock into an event, ``wait`` merges it into the
    waiting stream, ``synchronize`` merges a stream into the host's clock, which every later launch
    inherits (work issued after the host saw a stream finish runs after it).
    """

    overlap = True

    def __init__(self, names: tuple = ("engine", "canary")):
        self.streams = {n: _FakeStream(n) for n in names}
        self.clocks: dict[str, dict[str, int]] = {n: {} for n in self.streams}
        self.host: dict[str, int] = {}
        self._current = self.streams["engine"]
        self.log: list[Access] = []
        self.edges: list[tuple[str, str, str]] = []  # (kind, stream, detail) for readable dumps

    def side(self):
        return self.streams["canary"]

    def current(self):
        return self._current

    def record(self, stream):
        self.edges.append(("record", stream.name, ""))
        return dict(self._clock(stream.name))

    def wait(self, stream, event) -> None:
        if event is None:
            return
        self.edges.append(("wait", stream.name, ""))
        _merge(self.clocks[stream.name], event)

    @contextmanager
    def use(self, stream):
        prev, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = prev

    def synchronize(self, stream=None) -> None:
        _merge(self.host, self._clock((stream or self._current).name))

    def note(self, op: str, reads=(), writes=(), atomic=()) -> None:
        """``reads`` / ``writes`` / ``atomic``: resource names; an engine's input tensor stands for the input
        storage set it is a view of, ``("inputs", its data pointer)`` (a CUDA stream layer never resolves it)."""
        name = self._current.name
        clock = self._clock(name)
        clock[name] = clock.get(name, 0) + 1
        self.log.append(Access(len(self.log), name, op, dict(clock), _resources(reads), _resources(writes),
                               frozenset(atomic)))

    def _clock(self, name: str) -> dict:
        clock = self.clocks[name]
        _merge(clock, self.host)
        return clock

    def races(self) -> list[tuple[Access, Access, str]]:
        """(earlier, later, resource) for conflicting accesses on different streams with no ordering, in the log's
        order (by the later access, then the earlier)."""
        # An access a on stream s is ordered before a later b when b's clock has seen s's count at a. A stream's
        # own count grows with each of its accesses, so the accesses of s that b has not seen are the tail of s's
        # list past b's count of s: only those are paired (a recorded run logs thousands of accesses, tens of
        # millions of pairs). Where the counts do not grow in the log's order, every pair is tried.
        out = []
        counts: dict[str, list[int]] = {}
        issued: dict[str, list[Access]] = {}
        for b in self.log:
            unordered = []
            for stream, seen in counts.items():
                if stream != b.stream:
                    unordered += issued[stream][bisect.bisect_right(seen, b.clock.get(stream, 0)):]
            for a in sorted(unordered, key=lambda a: a.index):
                for res in _conflicts(a, b):
                    out.append((a, b, res))
            seen = counts.setdefault(b.stream, [])
            if seen and b.clock[b.stream] <= seen[-1]:
                return self._all_pairs()
            seen.append(b.clock[b.stream])
            issued.setdefault(b.stream, []).append(b)
        return out

    def _all_pairs(self) -> list[tuple[Access, Access, str]]:
        out = []
        for j, b in enumerate(self.log):
            for a in self.log[:j]:
                if a.stream == b.stream or b.clock.get(a.stream, 0) >= a.clock[a.stream]:
                    continue
                for res in _conflicts(a, b):
                    out.append((a, b, res))
        return out


def _resources(names) -> frozenset:
    return frozenset(("inputs", r.data_ptr()) if isinstance(r, torch.Tensor) else r for r in names)


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


def _conflicts(a: Access, b: Access) -> set:
    plain_a, plain_b = a.reads | a.writes, b.reads | b.writes
    out = (a.writes & (plain_b | b.atomic)) | (b.writes & (plain_a | a.atomic))
    # atomic updates commute with each other, not with plain reads (a snapshot) or writes
    out |= (a.atomic & b.reads) | (b.atomic & a.reads)
    return out


def streams_for(device: torch.device, overlap: bool):
    """The stream layer a Canary on ``device`` uses: a side stream on CUDA when overlap is on."""
    if overlap and device.type == "cuda":
        return CudaStreams(device)
    return InlineStreams()
