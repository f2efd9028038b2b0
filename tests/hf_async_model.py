"""transformers' async batching run on the CPU with its streams recorded (a test helper, not a test).

transformers refuses async batching off an accelerator, and on CUDA nothing says which access raced. Here
its async IO (two input/output pairs, an H2D, a D2H and a compute stream, their events) runs on the CPU with
stand-ins that record every stream operation into ``runtime.streams.RecordingStreams``, and the engine's device
work is noted there: each pair's host-to-device copy writes its inputs, the forward reads them (and writes its
carry-over ids into them, the KV and the outputs), the device-to-host copy reads the outputs. The canary runs
on the same recording (its side stream, the hooks' stream), with the adapter's step graphs on the CPU stand-in
of a CUDA graph, so ``races()`` lists every pair of conflicting accesses that no event orders: the adapter's
ordering against transformers' own, as the H200 would run it, lag or not.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from kvcanary.runtime.streams import RecordingStreams, _FakeStream
from memory_watch import watch_memory

from kvcanary.runtime.graphs import tensors_in as _flat

NAMES = ("h2d", "d2h", "compute")  # transformers makes its streams in this order (ContinuousBatchingAsyncIOs)


class TorchStream(_FakeStream):
    """A recorded stream with the methods transformers calls on a ``torch.cuda.Stream``."""

    def __init__(self, name: str, rec: RecordingStreams):
        super().__init__(name)
        self.rec = rec

    def record_event(self, event=None):
        event = event if event is not None else Event(self.rec)
        event.clock = self.rec.record(self)
        return event

    def wait_event(self, event) -> None:
        # (transformers' events, or the canary's own: RecordingStreams events are clocks)
        self.rec.wait(self, event.clock if isinstance(event, Event) else event)

    def wait_stream(self, other) -> None:
        self.rec.wait(self, self.rec.record(other))

    def synchronize(self) -> None:
        self.rec.synchronize(self)


class Event:
    """A ``torch.Event`` stand-in: the clock of its stream when recorded; ``synchronize`` is the host's wait."""

    def __init__(self, rec: RecordingStreams):
        self.rec, self.clock = rec, {}

    def synchronize(self) -> None:
        for k, v in self.clock.items():
            if v > self.rec.host.get(k, 0):
                self.rec.host[k] = v

    def query(self) -> bool:
        return True


def restart(rec: RecordingStreams) -> None:
    """Forget what was recorded so far (an earlier run's accesses and clocks); the streams stay."""
    rec.log.clear()
    rec.edges.clear()
    rec.host.clear()
    for clock in rec.clocks.values():
        clock.clear()
    memory = getattr(rec, "memory", None)
    if memory is not None:
        memory.storages.restart()


def runner_streams(monkeypatch, rec: RecordingStreams) -> None:
    """The step runner's CUDA stream calls on the recording: ``engine_stream`` puts the canary's work on the
    engine's compute stream after the current one, and a late step's side work starts after the forward
    (``ready``, recorded once the engine enqueued it)."""
    from kvcanary.runtime.step import carry as carry_mod
    from kvcanary.runtime.step.runner import StepRunner

    compute = rec.streams["compute"]

    def engine_stream(self):
        self.engine_calls += 1
        self.join()
        rec.wait(compute, rec.record(rec.current()))
        return rec.use(compute)

    def forward_enqueued(self):
        self.s.ready = rec.record(compute)

    monkeypatch.setattr(StepRunner, "engine_stream", engine_stream)
    monkeypatch.setattr(carry_mod.Carry, "forward_enqueued", forward_enqueued)


def _pair_key(io) -> tuple:
    return ("inputs", io.input_ids.data_ptr())  # (the canary's step graphs note their reads by this key)


@contextmanager
def recorded_async(monkeypatch, cuda_staging: bool = True, memory: bool = False, engine_graphs: bool = False):
    """Patch transformers' async IO, the adapter's CUDA-only checks and stream calls onto one recording;
    yields it. The adapter's step graphs run on ``DispatchGraph``; run with ``backend="triton"``.
    ``cuda_staging``: the step's host part staged as on CUDA (``STAGING_TURNS`` buffers, each refilled by a copy
    whose turn event the host waits for before it refills the turn again), not through the CPU's one buffer;
    and the step's close observed as on CUDA (``_cuda_observer``: snapshot slots and their events).
    ``memory``: every tensor access on the recording too (``memory_watch``: the caching allocator's reuse of freed
    memory, and conflicting accesses to any storage that no event orders).
    ``engine_graphs``: the engine's own CUDA graphs on ``DispatchGraph`` too (run with ``use_cuda_graph=True``): each
    pair's forward captured per padded shape (after one eager run, as transformers does) and replayed.
    """
    from transformers.generation.continuous_batching import continuous_api, input_outputs, model_runner, utils

    from kvcanary.integrations.transformers import handle as hf_handle
    from kvcanary.integrations.transformers import session as hf_session
    from kvcanary.runtime.graphs import DispatchGraph, capture
    from kvcanary.runtime.step import fused as fused_mod
    from kvcanary.runtime.step import graphs as step_graphs

    rec = RecordingStreams(("engine", "canary") + NAMES)
    for name in NAMES:
        rec.streams[name] = TorchStream(name, rec)
    made = iter(NAMES * 1000)  # (a batch processor per call: three streams each, same names)
    aio_cls, pair_cls = input_outputs.ContinuousBatchingAsyncIOs, input_outputs.HostDeviceIOPair

    def stream_context(stream):
        return nullcontext() if stream is None else rec.use(stream)

    for mod in (input_outputs, model_runner, utils, continuous_api):
        if hasattr(mod, "stream_context"):
            monkeypatch.setattr(mod, "stream_context", stream_context)
    monkeypatch.setattr(input_outputs, "create_device_stream", lambda device: rec.streams[next(made)])
    monkeypatch.setattr(aio_cls, "_supported_device_types", tuple(aio_cls._supported_device_types) + ("cpu",))

    orig_pair_init = pair_cls.__init__

    kinds = []  # (the pair makes its host IO, then its device IO: which one a set-up is for)

    def pair_init(self, *a, **k):
        kinds[:] = ["host", "device"]
        orig_pair_init(self, *a, **k)
        self.h2d_over, self.compute_over, self.d2h_over = Event(rec), Event(rec), Event(rec)

    io_cls = input_outputs.ContinuousBatchingIOs
    orig_io_init = io_cls.__init__

    def io_init(self, *a, **k):
        # what the host fills and what the device holds; the engine's set-up (its first resets) is taken as
        # ordered before its first step (on CUDA a synchronize comes between them)
        memory = getattr(rec, "memory", None)
        if memory is None or not kinds:
            return orig_io_init(self, *a, **k)
        with memory.paused():
            orig_io_init(self, *a, **k)
        kind = kinds.pop(0)
        register = memory.host if kind == "host" else memory.device
        for name, value in vars(self).items():
            register(*_flat(value), label=f"{kind} {name}")

    monkeypatch.setattr(io_cls, "__init__", io_init)

    monkeypatch.setattr(pair_cls, "__init__", pair_init)
    orig_h2d, orig_d2h = pair_cls.transfer_inputs_h2d, pair_cls.transfer_outputs_d2h

    def transfer_inputs_h2d(self, stream):
        with rec.use(stream):
            rec.note("h2d", writes=(_pair_key(self.device_io),))
        orig_h2d(self, stream)

    def transfer_outputs_d2h(self, stream):
        with rec.use(stream):
            rec.note("d2h", reads=(("outputs", _pair_key(self.device_io)[1]),))
        orig_d2h(self, stream)

    monkeypatch.setattr(pair_cls, "transfer_inputs_h2d", transfer_inputs_h2d)
    monkeypatch.setattr(pair_cls, "transfer_outputs_d2h", transfer_outputs_d2h)

    runner_cls = model_runner.ContinuousBatchingModelRunner if hasattr(
        model_runner, "ContinuousBatchingModelRunner") else next(
        c for c in vars(model_runner).values() if isinstance(c, type) and hasattr(c, "maybe_pad_inputs"))
    orig_forward = runner_cls._forward_process_and_sample

    def forward(self, *args):
        aio = self.inputs_and_outputs
        key = _pair_key(aio.io_pairs[aio.current_pair].device_io)
        with rec.use(rec.streams["compute"]):  # (the carry-over rewrites some of the ids first)
            rec.note("engine_forward", reads=(key,), writes=(key, "kv", ("outputs", key[1])))
        return orig_forward(self, *args)

    monkeypatch.setattr(runner_cls, "_forward_process_and_sample", forward)

    # the adapter: its async support is CUDA-only (checked at attach), its stream calls too
    orig_check = hf_handle.check_engine

    def check_engine(*a, **k):
        k["device"] = type("Device", (), {"type": "cuda"})()
        return orig_check(*a, **k)

    monkeypatch.setattr(hf_handle, "check_engine", check_engine)
    runner_streams(monkeypatch, rec)
    orig_build, orig_runner = hf_session.Session._build_canary, hf_session.Session._step_runner

    def build_canary(self):
        canary = orig_build(self)
        canary.launcher.streams = rec
        # (the host's value checks of a batch, "auto" on the CPU only: on CUDA the staged values are on the
        # device, which the host never reads; with CUDA's staging a batch's values arrive with the copy)
        canary._check_values = canary._check_values and not cuda_staging
        return canary

    monkeypatch.setattr(hf_session.Session, "_build_canary", build_canary)

    class Cache:  # (runtime.streams.stream_cache: the current stream, and a switch)
        def current(self):
            return rec.current()

        def set(self, stream):
            rec._current = stream

    # A capture runs nothing on CUDA and its replays run everything: the stand-in graph's notes are taken at each
    # replay, on the stream it replays on (the stand-in itself runs the work at the capture instead)
    orig_begin, orig_end, orig_replay = DispatchGraph.capture_begin, DispatchGraph.capture_end, DispatchGraph.replay

    capturing = []  # (the stand-in capture under way, if any: what the CUDA capture check answers)

    def capture_begin(self, **kw):
        # (a CUDA graph's temporaries live in its memory pool, which graphs captured into the same pool share:
        # two replays of such graphs on unordered streams would write each other's temporaries)
        self.notes = [("graph_replay", (), (("pool", id(kw.get("pool"))),), ())]
        if getattr(rec, "memory", None) is not None:
            rec.memory.captured = self.accesses = []
        capturing.append(self)
        rec.note = lambda op, reads=(), writes=(), atomic=(): self.notes.append((op, reads, writes, atomic))
        orig_begin(self, **kw)

    def capture_end(self):
        try:
            orig_end(self)
        finally:
            del rec.note
            capturing.pop()
            if getattr(rec, "memory", None) is not None:
                rec.memory.captured = None

    def replay(self):
        for event in getattr(self, "waits_on", ()):  # (a fused graph's first nodes: waits for its own events)
            rec.wait(rec.current(), event.clock)
        for op, reads, writes, atomic in getattr(self, "notes", ()):
            rec.note(op, reads, writes, atomic)
        if self.fresh and getattr(rec, "memory", None) is not None:
            rec.memory.replayed(getattr(self, "accesses", ()))  # (later replays run the work: seen as it runs)
        orig_replay(self)

    # (each CUDA pool a pool of its own here: the stand-in's pools are None)
    monkeypatch.setattr(step_graphs.StepGraphs, "new_pool", lambda self: object())
    monkeypatch.setattr(DispatchGraph, "capture_begin", capture_begin)
    monkeypatch.setattr(DispatchGraph, "capture_end", capture_end)
    monkeypatch.setattr(DispatchGraph, "replay", replay)
    if cuda_staging:
        _cuda_staging(monkeypatch, rec, Cache, lambda: bool(capturing))
        _cuda_observer(monkeypatch, rec, Cache)
    watching = watch_memory(monkeypatch, rec, lambda: bool(capturing)) if memory else nullcontext()
    if engine_graphs:
        _engine_graphs(monkeypatch, rec)

    # fused steps: their CUDA branch (events after the inputs and the forward, the side stream's replay, its
    # done event that the engine's streams join) on the recording; with in_graph_waits (the default, as on
    # CUDA) the graph's first nodes wait for two events of its own, which the host records before each replay:
    # a replay here waits for them as they were recorded at its launch
    orig_fused_init = fused_mod.FusedSteps.__init__

    def fused_init(self, graphs):
        orig_fused_init(self, graphs)
        self.cache, self.events = Cache(), (Event(rec), Event(rec), Event(rec))
        self.in_graph_waits = self.s.options.in_graph_waits

    def capture_waiting(self, graph, body, side):
        graph.waits_on = (Event(rec), Event(rec))
        for event in graph.waits_on:
            fused_mod.record_event(event, side)
        capture(graph, body, pool=self.pool)
        return graph.waits_on

    monkeypatch.setattr(fused_mod.FusedSteps, "__init__", fused_init)
    monkeypatch.setattr(fused_mod.FusedSteps, "_capture_waiting", capture_waiting)
    monkeypatch.setattr(fused_mod, "record_event", lambda event, stream: setattr(event, "clock", rec.record(stream)))
    monkeypatch.setattr(fused_mod, "event_wait", lambda event, stream: rec.wait(stream, event.clock))
    monkeypatch.setattr(hf_session.Session, "_step_runner", lambda self, graph_type=None: orig_runner(
        self, DispatchGraph))
    rec.memory = None
    with watching as watch:
        rec.memory = watch
        yield rec


def _cuda_staging(monkeypatch, rec: RecordingStreams, cache, capturing) -> None:
    """Each step runner's staging as on CUDA (``runtime/step/staging.py``, its own code): turn buffers refilled
    by a noted copy on the current stream, the turn's event recorded after it (or its fence), the host's wait
    for that event before the turn's next refill merged into the host's clock."""
    import torch

    from kvcanary.runtime.step import staging as staging_mod
    from kvcanary.runtime.step.runner import StepRunner

    class Torch:  # (the module's torch: pinned host buffers are plain ones on the CPU)
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*a, pin_memory=False, **k):
            return torch.empty(*a, **k)

    monkeypatch.setattr(staging_mod, "torch", Torch())
    monkeypatch.setattr(staging_mod, "capturing", capturing)
    monkeypatch.setattr(staging_mod, "event_synchronize", lambda event: event.synchronize())
    monkeypatch.setattr(staging_mod, "record_event", lambda event, stream: setattr(event, "clock", rec.record(stream)))
    orig_copy, orig_init, orig_send = staging_mod.Staging.copy, StepRunner.__init__, staging_mod.Staging.send

    def copy(self):
        if self.pending is not None:
            rec.note("stage_copy", writes=(self.pending[0],))
        orig_copy(self)

    def send(self, parts, copy=True, last=None):
        # (the host's numpy write into the turn's pinned buffer, after its wait for the turn: before any copy)
        turn, grown = self.turn, self.size
        out = orig_send(self, parts, False, last)
        memory = getattr(rec, "memory", None)
        if memory is not None:
            if self.size != grown or not self.host:
                memory.host(*self.host, label="staging host")
            memory.host_write(self.host[turn], "staging send")
        if copy:
            self.copy()
        return out

    def runner_init(self, canary, source, *a, **k):
        orig_init(self, canary, source, *a, **k)
        stage = staging_mod.Staging(self.device)
        stage.cuda, stage.events, stage.stream = True, [Event(rec) for _ in range(stage.depth)], cache()
        source.stage = stage

    monkeypatch.setattr(staging_mod.Staging, "copy", copy)
    monkeypatch.setattr(staging_mod.Staging, "send", send)
    monkeypatch.setattr(StepRunner, "__init__", runner_init)


def _cuda_observer(monkeypatch, rec: RecordingStreams, cache) -> None:
    """The canary's observer as on CUDA (``runtime/observer.py``, its own code): ``NUM_SLOTS`` snapshot slots, each
    copied into on the stream that closes the step (a fused step: inside its graph), its event recorded after the
    copy into (pinned) host memory and read by the host only once that event is known complete. The slot's
    event also stands for the fused step's end (the engine's streams join it) and for its staging turn's copy
    (``SlotFence``: the turn's next refill waits for it): the parts of the stream model the CPU's one
    eagerly read slot leaves out."""
    from kvcanary.runtime import observer as observer_mod

    orig_init = observer_mod.HostObserver.__init__

    class HostValues:  # (the slot's numpy view of its pinned values: the host's read of them noted where it reads)
        def __init__(self, t):
            self.t, self.np = t, t.numpy()

        def tolist(self):
            memory = getattr(rec, "memory", None)
            if memory is not None:
                memory.host_read(self.t, "observe")
            return self.np.tolist()

    def init(self, ring, watched, **kw):
        orig_init(self, ring, watched, **kw)
        self.cuda, self.streams = True, cache()
        size = self.slots[0].small.numel()
        self.slots = [observer_mod._Slot(ring, size, False, i, self.record_bufs, self.tables)
                      for i in range(observer_mod.NUM_SLOTS)]
        memory = getattr(rec, "memory", None)
        for slot in self.slots:  # (pinned host memory and an event: plain memory and the recording's)
            slot.host_small = slot.small.clone()
            slot.host_np, slot.event = HostValues(slot.host_small), Event(rec)
            if memory is not None:
                memory.host(slot.host_small, label="observer slot")

    def query(event):  # (complete at once here: the host learns that the event's stream got so far)
        event.synchronize()
        return True

    monkeypatch.setattr(observer_mod.HostObserver, "__init__", init)
    monkeypatch.setattr(observer_mod, "record_event", lambda event, stream: setattr(event, "clock", rec.record(stream)))
    monkeypatch.setattr(observer_mod, "event_query", query)
    monkeypatch.setattr(observer_mod, "event_synchronize", lambda event: event.synchronize())


def _engine_graphs(monkeypatch, rec: RecordingStreams) -> None:
    """transformers' CUDA graphs on the CPU stand-in: a graph backend is declared, its memory pools are none, and
    a capture records the forward on the compute stream. A CUDA capture runs nothing and the engine does not
    replay right after it (its eager run before the capture did the work): the stand-in's capture runs the
    forward a second time (the same inputs: the same writes), and its first replay runs everything."""
    from transformers.generation.continuous_batching import initialization, model_runner

    from kvcanary.runtime.graphs import DispatchGraph

    @contextmanager
    def capture_context(graph, stream, pool):
        with rec.use(stream):
            graph.capture_begin(pool=pool)
            try:
                yield
            finally:
                graph.capture_end()
        graph.fresh = False

    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "CUDAGraph")
    monkeypatch.setattr(model_runner, "get_memory_pools", lambda: (None, None))
    monkeypatch.setattr(model_runner, "memory_pool_context", lambda pool: nullcontext())
    monkeypatch.setattr(model_runner, "create_accelerator_graph", DispatchGraph)
    monkeypatch.setattr(model_runner, "accelerator_graph_capture_context", capture_context)
