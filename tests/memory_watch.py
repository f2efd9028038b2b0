"""Every tensor access on a ``RecordingStreams`` recording, checked as CUDA would run it (a test helper, not a test).

The recording's named notes (``streams.note``) say what the canary's launches read and write by name; what no
note names is invisible to ``races()``. ``watch_memory`` sees every aten op (a ``TorchDispatchMode``, on the test's
thread and on transformers' generation thread) and every Triton launch, on the stream current at the call, and
checks two things per storage with the recording's vector clocks:

- ``StorageRaces``: conflicting accesses (a write against any earlier access) on different streams, or between a
  stream and the host, with no event or host sync between them (a FastTrack-style check: per storage, its last
  write and the reads since). Host memory (the engine's host inputs, the canary's pinned staging buffers:
  registered with ``host``) filled by the host is accessed at the host's clock; an op that reads or writes device
  memory runs on the current stream. An aten op writes what its schema marks written (and its results); a view
  op accesses nothing; a Triton launch writes the tensors whose bytes it changed.
- ``AllocatorWatch``: CUDA's caching allocator gives a freed tensor's memory to its own stream's next
  allocation at once, unless ``record_stream`` named the other streams that used it: a tensor used on another
  stream and freed before that use is ordered before its own stream is listed (as a ``free`` note against a
  ``use`` note, which ``races()`` pairs).

Allocations inside a capture belong to the graph's pool: not watched for frees.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from kvcanary.runtime.graphs import tensors_in as _flat
from kvcanary.runtime.streams import RecordingStreams

LARGE = 16 << 20  # bytes: a Triton launch's tensor larger than this is taken as read only (the KV pool)


_WRITTEN: dict = {}  # aten op -> (position, name) of each argument its schema marks written


def _written_args(func) -> tuple:
    found = _WRITTEN.get(func)
    if found is None:
        found = _WRITTEN[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                       if a.alias_info is not None and a.alias_info.is_write)
    return found


class StorageRaces:
    """Conflicting accesses to one storage that nothing orders (see the module's docstring)."""

    def __init__(self, rec: RecordingStreams):
        self.rec = rec
        self.state: dict = {}  # cdata -> [weak ref, "host" | "device", label, last write, {stream: read}]
        self.found: dict = {}  # (label, earlier, later) -> count

    def kind(self, st) -> str | None:
        e = self._entry(st)
        return None if e is None else e[1]

    def classify(self, st, kind: str, label: str, force: bool = False) -> None:
        """Watch storage ``st`` as ``kind`` memory; ``force``: a registration, which overrides a guess."""
        e = self._entry(st)
        if e is None and st.nbytes():
            self.state[st._cdata] = [StorageWeakRef(st), kind, label, None, {}]
        elif e is not None and force:
            e[1], e[2] = kind, label

    def _entry(self, st):
        e = self.state.get(st._cdata)
        if e is not None and e[0].expired():  # (a new storage took a freed one's cdata)
            del self.state[st._cdata]
            return None
        return e

    def access(self, st, write: bool, op: str, host: bool) -> None:
        e = self._entry(st)
        if e is None:
            return
        rec = self.rec
        if host:
            where, clock = "host", rec.host
        else:
            where = rec.current().name
            clock = rec._clock(where)
        clock[where] = count = clock.get(where, 0) + 1
        last = e[3]
        if last is not None and last[0] != where and clock.get(last[0], 0) < last[1]:
            self._race(e, last, where, op)
        if write:
            for stream, read in e[4].items():
                if stream != where and clock.get(stream, 0) < read[0]:
                    self._race(e, (stream, *read), where, op)
            e[3], e[4] = (where, count, op), {}
        else:
            e[4][where] = (count, op)

    def _race(self, e, earlier, where: str, op: str) -> None:
        key = (e[2], f"{earlier[-1]}@{earlier[0]}", f"{op}@{where}")
        self.found[key] = self.found.get(key, 0) + 1

    def restart(self) -> None:
        """Forget the accesses so far (the recording's clocks start again)."""
        self.found.clear()
        for e in self.state.values():
            e[3], e[4] = None, {}

    def races(self) -> list[tuple[str, str, str]]:
        """(storage, earlier access, later access) of each unordered conflict, each listed once."""
        return sorted(self.found)


class AllocatorWatch:
    """CUDA's caching allocator as far as ordering goes (see the module's docstring)."""

    def __init__(self, rec: RecordingStreams, capturing):
        self.rec, self.capturing = rec, capturing
        # storage cdata -> [weak ref, allocating stream, op, {stream: its count at the last use}, recorded
        # streams, a number of its own (a storage made later may take a freed one's cdata)]
        self.live: dict = {}
        self.used: dict = {}  # the live entries used on another stream (checked for frees after each op)
        self.made = 0
        # the used entries whose storage's Python object was finalized since the last check (a finalizer on it: the
        # object lives as long as the storage, torch keeps it while the storage lives), so the check after an op
        # looks at those only
        self.freed: list = []

    def op(self, name, inputs, outputs) -> None:
        here = self.rec.current().name
        seen = set()
        for t in inputs:
            cdata = t.untyped_storage()._cdata
            seen.add(cdata)
            e = self.live.get(cdata)
            if e is None or e[1] == here or e[0].expired():
                continue
            if e[3].get(here) != self.rec.clocks[here].get(here, 0):  # (no access on its stream since: alike)
                self.rec.note(f"use:{name} of {e[2]}", reads=(("memory", e[5]),))
                e[3][here] = self.rec.clocks[here][here]
                if cdata not in self.used:
                    weakref.finalize(t.untyped_storage(), self._on_free, cdata)
                self.used[cdata] = e
        if not self.capturing():
            for t in outputs:
                st = t.untyped_storage()
                cdata = st._cdata
                e = self.live.get(cdata)
                if cdata not in seen and st.nbytes() and (e is None or e[0].expired()):
                    self.made += 1
                    self.live[cdata] = [StorageWeakRef(st), here, name, {}, set(), self.made]
        self._frees()
        if len(self.live) > 4096:
            self.live = {k: e for k, e in self.live.items() if not e[0].expired()}

    def recorded(self, t, stream: str) -> None:
        e = self.live.get(t.untyped_storage()._cdata)
        if e is not None:
            e[4].add(stream)

    def _on_free(self, cdata: int) -> None:
        self.freed.append(cdata)

    def _frees(self) -> None:
        if not self.freed:
            return
        freed, self.freed = self.freed, []
        for cdata in freed:
            e = self.used.get(cdata)
            if e is None:
                continue
            if not e[0].expired():  # (finalized before its storage's release ended: another thread's free)
                self.freed.append(cdata)
                continue
            del self.used[cdata]
            if self.live.get(cdata) is e:
                del self.live[cdata]
            if set(e[3]) <= e[4]:
                continue  # (record_stream: the allocator waits for those streams' work)
            with self.rec.use(self.rec.streams[e[1]]):
                self.rec.note(f"free of {e[2]}", writes=(("memory", e[5]),))


class MemoryWatch:
    """Both checks, fed by ``watch_memory``; ``host(t)`` registers host memory (the host fills it)."""

    def __init__(self, rec: RecordingStreams, capturing):
        self.rec = rec
        self.allocator = AllocatorWatch(rec, capturing)
        self.storages = StorageRaces(rec)
        self.pause = 0
        # a capture under way: its accesses, kept for the graph's replays (a CUDA capture runs nothing; the
        # stand-in's runs its work at once, before the waits its replays will follow)
        self.captured: list | None = None

    def _access(self, st, write: bool, op: str, host: bool) -> None:
        if self.captured is not None and not host:
            self.captured.append((st, write, op))
        else:
            self.storages.access(st, write, op, host)

    def replayed(self, accesses: list) -> None:
        """A captured graph's first replay (the stand-in ran its work at the capture): its accesses, now."""
        for st, write, op in accesses:
            self.storages.access(st, write, op, False)

    @contextmanager
    def paused(self):
        """Accesses in the block are not checked (an engine's set-up, ordered before its steps otherwise)."""
        self.pause += 1
        try:
            yield
        finally:
            self.pause -= 1

    def host(self, *tensors, label: str = "host") -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.storages.classify(t.untyped_storage(), "host", label, force=True)

    def device(self, *tensors, label: str = "device") -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.storages.classify(t.untyped_storage(), "device", label, force=True)

    def host_write(self, t: torch.Tensor, op: str) -> None:
        """The host wrote ``t`` itself (numpy, not an aten op)."""
        self.storages.access(t.untyped_storage(), True, op, host=True)

    def host_read(self, t: torch.Tensor, op: str) -> None:
        """The host read ``t`` itself (numpy, not an aten op)."""
        self.storages.access(t.untyped_storage(), False, op, host=True)

    def aten(self, func, args, kwargs, out) -> None:
        name = func.__name__
        ins, outs = _flat((args, kwargs)), _flat(out)
        self.allocator.op(name, ins, outs)
        if self.pause or func.is_view or name.startswith(("set_", "_local_scalar_dense")):
            return
        written = set()
        for i, arg in _written_args(func):  # (positional, else by keyword)
            value = args[i] if i < len(args) else kwargs.get(arg)
            written.update(t.untyped_storage()._cdata for t in _flat(value))
        outs = [t.untyped_storage() for t in outs]
        written.update(st._cdata for st in outs)
        storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in ins}
        storages.update((st._cdata, st) for st in outs)
        kinds = {c: self.storages.kind(st) for c, st in storages.items()}
        device = "device" in kinds.values()
        host = not device and ("host" in kinds.values())
        for c, st in storages.items():
            if kinds[c] is None:
                self.storages.classify(st, "host" if host else "device", f"{name} ({st.nbytes()} bytes)")
            if ins:  # (a factory's fill of new memory conflicts with nothing: its memory was no one's before)
                self._access(st, c in written, name, host)

    def launch(self, fn, kw: dict, run) -> None:
        """A Triton launch: ``run()`` runs it; the tensors whose bytes it changed are its writes."""
        tensors = {t.untyped_storage()._cdata: t for t in _flat(kw)}
        before = {c: t.untyped_storage().clone() if 0 < t.untyped_storage().nbytes() <= LARGE else None
                  for c, t in tensors.items()}
        run()
        name = getattr(fn, "__name__", "kernel")
        self.allocator.op(name, list(tensors.values()), ())
        for c, t in tensors.items():
            st = t.untyped_storage()
            if self.storages.kind(st) is None:
                self.storages.classify(st, "device", name)
            old = before[c]
            changed = old is not None and not torch.equal(
                torch.empty(0, dtype=torch.uint8).set_(old), torch.empty(0, dtype=torch.uint8).set_(st))
            self._access(st, changed, name, False)

    def races(self) -> list[tuple[str, str, str]]:
        return self.storages.races()


@contextmanager
def watch_memory(monkeypatch, rec: RecordingStreams, capturing=lambda: False):
    """A ``MemoryWatch`` over the block: every aten op and Triton launch, and the canary's hand-overs
    (``record_stream``). Allocator races show in ``rec.races()``; storage races in ``watch.races()``."""
    from kvcanary.ops import triton_ops
    from kvcanary.runtime.launch import ForwardLauncher

    watch = MemoryWatch(rec, capturing)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            watch.aten(func, args, kwargs, out)
            return out

    orig_launch, orig_hand = triton_ops._launch, ForwardLauncher.hand_over

    def launch(fn, grid, **kw):
        def run():
            with _disable_current_modes():  # (the interpreter's own tensor calls: the kernel's tensors are seen)
                orig_launch(fn, grid, **kw)
        watch.launch(fn, kw, run)

    def hand_over(self, *tensors):
        orig_hand(self, *tensors)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                watch.allocator.recorded(t, self.streams.side().name)

    monkeypatch.setattr(triton_ops, "_launch", launch)
    monkeypatch.setattr(ForwardLauncher, "hand_over", hand_over)
    try:  # (a dispatch mode is the thread's own: transformers generates on a thread of its own)
        from transformers.generation.continuous_batching import continuous_api
    except ImportError:
        continuous_api = None
    if continuous_api is not None:
        manager = continuous_api.ContinuousBatchingManager
        orig_loop = manager._run_generation_loop

        def loop(self, *a, **k):
            with Mode():
                return orig_loop(self, *a, **k)

        monkeypatch.setattr(manager, "_run_generation_loop", loop)
    with Mode():
        yield watch
