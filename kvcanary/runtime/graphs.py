"""The HEAD and TAIL launch sequences captured once per shape and replayed.

Once the batch is staged (``launch.py``), the verify and write launches of a phase read only the
canary's static buffers: the staged inputs, the plan, the canary buffers, the ring. Their
arguments then depend on the batch only through a few host-known sizes (requests, tokens, which
optional inputs are present): that tuple is the key. A key seen a second time is captured (on
CUDA into a ``torch.cuda.CUDAGraph`` on the side stream) and every later forward with that key
replays it: one host call instead of one launch per kernel. Decode steps of a steady batch hit
one key; prefill chunks of varying length mostly run eagerly, their first sighting never captured.

``FakeGraphs`` is the CPU stand-in used by tests: "capture" records the calls without running
them, "replay" runs the recorded calls. A launch argument that is not a static buffer (a tensor
of the engine's batch) then reads stale data on replay, and results differ from the eager run.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from contextlib import contextmanager
from functools import partial

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from kvcanary.runtime.streams import capturing, stream_cache

MAX_GRAPHS = 16  # captured sequences kept (least recently used dropped): TAIL shapes, snapshot slots


@contextmanager
def gc_paused():
    """Python's cyclic collector paused around a CUDA-graph capture: a collection inside it can free
    an unreachable CUDA graph (an old session's), and destroying a graph while a stream captures is
    an error that invalidates the capture (seen as a flaky failure in a GPU suite run)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def capture(graph, body, pool=None) -> None:
    """Record ``body()`` into ``graph`` (a ``torch.cuda.CUDAGraph`` or a stand-in): thread-local, since
    the engine's other threads may keep issuing CUDA calls meanwhile, and with the collector paused."""
    with gc_paused():
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            body()
        finally:
            graph.capture_end()


_C_REPLAY = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None)


def replay_of(graph):
    """``graph.replay`` as one C call for a torch CUDA graph captured without input-liveness tracking
    (its Python wrapper adds only that check, and a Python call costs the host more than the replay's
    launch inside a step); the graph's own method for anything else (the CPU stand-ins)."""
    if (_C_REPLAY is not None and isinstance(graph, torch.cuda.CUDAGraph)
            and getattr(graph, "_tracker", None) is None):
        return partial(_C_REPLAY, graph)
    return graph.replay


class _Replayable:
    """A captured CUDA graph with its C replay (``replay_of``); keeps the graph alive."""

    __slots__ = ("graph", "replay")

    def __init__(self, graph):
        self.graph, self.replay = graph, replay_of(graph)


def eager(fn, *args, **kw) -> None:
    fn(*args, **kw)


class _Held:
    """A tensor a stand-in graph reads or writes but did not make in its capture, held as a CUDA graph holds
    it: by address only. A CUDA graph keeps no tensor alive, and a replay after the tensor's last owner let
    it go reads (or writes) whatever took its memory since: a stand-in's strong reference would hide that.
    So the stand-ins keep a weak reference to the storage, and a replay after it was freed raises."""

    __slots__ = ("ref", "geometry")

    def __init__(self, t: torch.Tensor):
        self.ref = StorageWeakRef(t.untyped_storage())
        self.geometry = (t.dtype, t.device, t.storage_offset(), tuple(t.shape), t.stride())

    def get(self, op) -> torch.Tensor:
        dtype, device, offset, shape, stride = self.geometry
        if self.ref.expired():
            raise RuntimeError(f"kv-canary: a captured sequence's {getattr(op, '__name__', op)} uses a {dtype} "
                               f"tensor of shape {list(shape)} freed since the capture: a CUDA graph would read or "
                               "write whatever memory took its place (keep it alive with the graph)")
        storage = torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


def _map(x, fn):
    """``x`` with ``fn`` applied to each leaf of its nested tuples, lists and dict values."""
    if isinstance(x, (tuple, list)):
        return type(x)(_map(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return fn(x)


def _hold(x, owned=frozenset()):
    """``x`` (a call's arguments) with every tensor whose storage is not in ``owned`` held weakly."""
    def leaf(t):
        if not isinstance(t, torch.Tensor) or t.untyped_storage()._cdata in owned or not t.untyped_storage().nbytes():
            return t
        return _Held(t)
    return _map(x, leaf)


def _resolve(x, op):
    """``_hold``'s inverse at a replay: the held tensors as they are now (raises for a freed one)."""
    return _map(x, lambda v: v.get(op) if type(v) is _Held else v)


class _Recorded:
    """FakeGraphs' capture: the calls a body issued, their tensors held as a CUDA graph holds them (``_Held``)."""

    def __init__(self):
        self.calls: list = []

    def call(self, fn, *args, **kw) -> None:
        self.calls.append((fn, _hold(args), _hold(kw)))

    def replay(self) -> None:
        with _disable_current_modes():  # (the held tensors' views are not part of any capture under way)
            calls = [(fn, _resolve(args, fn), _resolve(kw, fn)) for fn, args, kw in self.calls]
        for fn, args, kw in calls:
            fn(*args, **kw)


class EagerGraphs:
    """No capture: every phase launches its kernels one by one."""

    def __init__(self):
        self.captures = self.replays = 0

    def run(self, key, body, seen_as=None) -> None:
        body(eager)


class FakeGraphs(EagerGraphs):
    """CPU stand-in: capture on a key's second sighting records the calls; replays run them."""

    eager_now = None  # a check that says the sequence must run eagerly now (CudaGraphs: while capturing)

    def __init__(self, max_graphs: int = MAX_GRAPHS):
        super().__init__()
        self.cache: OrderedDict = OrderedDict()
        self.seen: set = set()
        self.max_graphs = max_graphs

    def run(self, key, body, seen_as=None) -> None:
        """``seen_as``: the key whose first sighting runs eagerly, when not ``key`` itself (a sequence
        keyed per snapshot slot has compiled its kernels once any slot ran it)."""
        if self.eager_now is not None and self.eager_now():
            body(eager)
            return
        g = self.cache.get(key)
        if g is None:
            seen = key if seen_as is None else seen_as
            if seen not in self.seen:
                self.seen.add(seen)
                body(eager)
                return
            g = self._capture(body)
            self.captures += 1
            self.cache[key] = g
            while len(self.cache) > self.max_graphs:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        g.replay()
        self.replays += 1

    def _capture(self, body):
        rec = _Recorded()
        body(rec.call)
        return rec


class CudaGraphs(FakeGraphs):
    """CUDA graphs replayed on the current stream; eager while the engine itself captures. The legacy
    default stream cannot capture: a sequence first met there is captured on a stream of its own
    (a capture runs nothing, so no ordering is needed) and replayed where it was met."""

    def __init__(self, device: torch.device, max_graphs: int = MAX_GRAPHS):
        super().__init__(max_graphs)
        self.device = device
        self.streams = stream_cache(device)
        self.default = torch.cuda.default_stream(device).cuda_stream  # (its raw handle: compared per capture)
        self.capture_stream: torch.cuda.Stream | None = None
        self.eager_now = capturing  # (a C call: no Python frame of a run method of its own per replay)

    def _capture(self, body):
        g = torch.cuda.CUDAGraph()
        if self.streams.current().cuda_stream != self.default:
            capture(g, lambda: body(eager))
            return _Replayable(g)
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream(device=self.device)
        with self.streams.use(self.capture_stream):
            capture(g, lambda: body(eager))
        return _Replayable(g)


def graphs_for(device: torch.device, enabled: bool):
    if enabled and device.type == "cuda":
        return CudaGraphs(device)
    return EagerGraphs()


class DispatchGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph`` (tests of whole-step capture, ``integrations/hf_graph.py``).

    Between ``capture_begin`` and ``capture_end`` every aten op and every Triton launch runs and is
    recorded with the tensors it read and the tensors it returned; ``replay`` runs them again and
    writes each op's new result into the tensor returned at capture, as a CUDA graph rewrites the
    same memory. Host values read during the capture are baked in, as in a real graph: work that
    depends on anything but the recorded tensors' contents gives different results on replay, and a
    host read of a tensor value (``.item()``, ``.tolist()``) inside the capture raises. The first
    ``replay`` after a capture does nothing: the capture already ran the work (a CUDA capture runs
    nothing, its first replay everything). Like a CUDA graph it keeps alive only the tensors its capture made
    (its pool): the others are held by address (``_Held``), and a replay after one was freed raises.
    """

    def __init__(self):
        self.calls: list = []
        self.fresh = False
        self._mode = None
        self._launch = None

    def capture_begin(self, **_) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        from kvcanary.ops import triton_ops

        graph = self

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
                            torch.ops.aten.is_nonzero.default):
                    raise RuntimeError("kv-canary: a host read of a device value inside a captured step")
                out = func(*args, **(kwargs or {}))
                graph.calls.append((func, args, kwargs or {}, out))
                return out

        launch = self._launch = triton_ops._launch

        def recorded_launch(fn, grid, **kw):
            self.calls.append((launch, (fn, grid), kw, None))
            with torch.utils._python_dispatch._disable_current_modes():
                launch(fn, grid, **kw)

        triton_ops._launch = recorded_launch
        self._mode = Record()
        self._mode.__enter__()

    def capture_end(self) -> None:
        from kvcanary.ops import triton_ops

        self._mode.__exit__(None, None, None)
        triton_ops._launch = self._launch
        self.fresh = True
        # the storages the capture made (first met as a result, not as an argument): the graph's own; every
        # other tensor is held by address, as a CUDA graph holds it
        seen, owned = set(), set()
        for fn, args, kw, out in self.calls:
            if fn is torch.ops.aten.lift_fresh.default:
                # a host constant made into a tensor for one op (``x[:1] = 0``): baked into the graph, as a CUDA
                # graph bakes a fill's value into its kernel
                owned.update(t.untyped_storage()._cdata for t in tensors_in(args))
                continue
            seen.update(t.untyped_storage()._cdata for t in tensors_in((args, kw)))
            owned.update(c for c in (t.untyped_storage()._cdata for t in tensors_in(out)) if c not in seen)
        self.calls = [(fn, _hold(args, owned), _hold(kw, owned), _hold(out, owned))
                      for fn, args, kw, out in self.calls]

    def reset(self) -> None:
        """Forget the captured work (``torch.cuda.CUDAGraph.reset``)."""
        self.calls, self.fresh = [], False

    def replay(self) -> None:
        if self.fresh:
            self.fresh = False
            return
        for fn, args, kw, out in self.calls:
            with _disable_current_modes():
                args, kw, out = _resolve(args, fn), _resolve(kw, fn), _resolve(out, fn)
            res = fn(*args, **kw)
            for old, new in zip(tensors_in(out), tensors_in(res)):
                if old.data_ptr() != new.data_ptr() or old.stride() != new.stride():
                    old.copy_(new)


def tensors_in(x) -> list:
    """Every tensor in ``x`` (nested tuples, lists and dict values), in order (into one list: the tests' memory
    watch walks every aten op's arguments with it)."""
    out: list = []
    _collect_tensors(x, out)
    return out


def _collect_tensors(x, out: list) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _collect_tensors(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _collect_tensors(v, out)
