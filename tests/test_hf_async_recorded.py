"""transformers' async batching under the canary on the CPU, its streams recorded (``tests/hf_async_model.py``).

transformers refuses async batching off an accelerator; here its async IO runs on the CPU with stand-in streams
that record every event and wait, beside the canary's own stream work, with the adapter's step graphs (and
fused steps) on the CPU stand-in of a CUDA graph and the step's host part staged as on CUDA (turn buffers
refilled by copies). A clean run must report nothing, generate what the same
async run without the canary generates, and leave no two conflicting accesses unordered; with a wait the design
depends on dropped, the recording must name the access it left unordered. The canary runs the torch backend as on
an accelerator (``device_bounds``: no host read, so the stand-in graphs record its ops); one clean run takes
Triton's launches (under ``TRITON_INTERPRET=1``)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("triton")

import transformers  # noqa: E402

from kvcanary.demo import build_tiny_model, run_workload  # noqa: E402
from kvcanary.integrations.transformers.layout import ASYNC_SINCE, parse_version  # noqa: E402

pytestmark = [
    pytest.mark.skipif(parse_version(transformers.__version__) < ASYNC_SINCE,
                       reason="async IO needs transformers >= 5.24"),
    pytest.mark.usefixtures("device_bounds"),  # (tests/conftest.py: the torch backend's device path, recorded)
]
TRITON = pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                            reason="the CPU stand-in graphs record Triton launches under TRITON_INTERPRET=1")

ASYNC = {"use_cuda_graph": False, "use_async_batching": True}
# 16 new tokens: 25 forwards (above the clean runs' `forwards > 20`; 24 tokens made 33), with the
# per-turn and fused paths reached (STEADY_SIGHTINGS 2)
RUN = dict(device="cpu", num_return_sequences=1, max_new_tokens=16, backend="torch")


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model("cpu")


@pytest.fixture
def steady(monkeypatch):
    from kvcanary.runtime.step import graphs

    monkeypatch.setattr(graphs, "STEADY_SIGHTINGS", 2)  # (a short run reaches the per-turn and fused paths)


_BASE: dict = {}  # the canary-less async run of each workload, once per test process (its tokens do not change)


def _recorded_run(llama, monkeypatch, memory=False, tokens=None, base=True, **options):
    """(the canary-less async run, the canary's run, the recording of the canary's run alone); ``base=False``: no
    canary-less run (None)"""
    from hf_async_model import recorded_async

    workload = {**RUN, **({} if tokens is None else {"max_new_tokens": tokens}),
                **({"backend": options.pop("backend")} if "backend" in options else {})}
    key = tuple(sorted((k, v) for k, v in workload.items() if k != "backend"))  # (no canary: no backend)
    if base and key not in _BASE:
        _BASE[key] = _base_run(llama, ASYNC, **workload)
    with recorded_async(monkeypatch, memory=memory) as rec:
        run = run_workload(llama, cb=ASYNC, **workload, **options)
    return (_BASE[key] if base else None), run, rec


def _base_run(llama, cb, engine_graphs=False, **workload):
    """The canary-less async run (only its tokens are compared): on a recording of its own, with no memory watch
    (the watch sees every aten op; the canary's run is the one it checks), its patches undone after it."""
    from hf_async_model import recorded_async

    with pytest.MonkeyPatch.context() as mp, recorded_async(mp, engine_graphs=engine_graphs):
        return run_workload(llama, canary=False, cb=cb, **workload)


@pytest.mark.parametrize("fused, backend", [(True, "torch"), (False, "torch"),
                                            pytest.param(True, "triton", marks=TRITON)],
                         ids=["fused", "unfused", "fused-triton"])
def test_a_clean_async_run_is_clean_and_ordered(llama, monkeypatch, steady, fused, backend):
    from kvcanary.runtime.step.fused import FusedSteps

    from kvcanary.runtime.step import staging as staging_mod

    replays, fenced = [], []
    orig = FusedSteps._replay
    monkeypatch.setattr(FusedSteps, "_replay", lambda self, *a: (replays.append(1), orig(self, *a))[1])
    orig_copied = staging_mod.Staging.copied
    monkeypatch.setattr(staging_mod.Staging, "copied",
                        lambda self, fence=None: (fenced.append(fence is not None), orig_copied(self, fence))[1])
    # (with the allocator's reuse of freed memory: a tensor used on another stream than the one it was made on)
    # (the Triton case's accesses are the torch cases' by storage: its recording checks the streams, not each storage)
    base, run, rec = _recorded_run(llama, monkeypatch, memory=backend != "triton", fused_steps=fused, backend=backend)
    assert run.violations == [], run.report
    assert run.tokens == base.tokens and run.stats["forwards"] > 20
    assert bool(replays) == fused  # (the path under test ran)
    # the step's close as on CUDA (hf_async_model._cuda_observer): a fused step closes into a snapshot slot, whose
    # event also stands for its staging turn's copy (SlotFence); ordered per storage (below)
    assert any(fenced) == fused, "a fused step's close into a snapshot slot"
    ops = {a.op.split(":")[0] for a in rec.log}
    want = {"h2d", "engine_forward", "d2h", "stage_copy", "stage", "head", "tail", "reserved_check"}
    assert want | ({"use"} if rec.memory is not None else set()) <= ops, ops  # ("use": the storages' watch)
    assert rec.races() == [], [(a.op, a.stream, b.op, b.stream, r) for a, b, r in rec.races()[:5]]
    assert rec.memory is None or rec.memory.races() == []  # (every storage's accesses, named or not)


@pytest.mark.slow  # (a heavy extra: the engine's CUDA-graph run below pads its inputs and warms up as this one does)
def test_a_clean_async_run_over_the_engines_padded_inputs_is_clean_and_ordered(llama, monkeypatch, steady):
    # the engine pads its inputs for its CUDA graphs (padding tokens at position 0 writing its trash slot) and
    # warms both input pairs up with fake requests first; the canary reads no padding lane as a live token
    from test_transformers import pad_engine

    pads, warmups = pad_engine(monkeypatch)
    base, run, rec = _recorded_run(llama, monkeypatch, memory=True)
    assert run.violations == [], run.report
    assert run.tokens == base.tokens
    assert warmups and any(out[0] > got[0] for got, out in pads), pads[:4]  # (the engine padded)
    assert rec.races() == [], [(a.op, a.stream, b.op, b.stream, r) for a, b, r in rec.races()[:5]]
    assert rec.memory is None or rec.memory.races() == []  # (every storage's accesses, named or not)


def test_a_clean_async_run_with_the_engines_cuda_graphs_is_clean_and_ordered(llama, monkeypatch, steady):
    # the engine's fastest configuration: its forward captured per pair and padded shape, replayed (on the
    # CPU stand-in), async batching on; the engine's padding as its graphs need it
    from hf_async_model import recorded_async
    from transformers.generation.continuous_batching import model_runner

    cb = {"use_cuda_graph": True, "use_async_batching": True}
    pads, warmups = [], []
    orig_pad, orig_warm = model_runner.ModelRunner.maybe_pad_inputs, model_runner.ModelRunner.run_one_warmup
    base = _base_run(llama, cb, engine_graphs=True, **RUN)
    with recorded_async(monkeypatch, memory=True, engine_graphs=True) as rec:
        # the engine pads its inputs for its graphs (padding tokens at position 0 writing its trash slot) and warms
        # both input pairs up with fake requests first; the canary reads no padding lane as a live token
        def pad(self, num_q_tokens, max_kv_read, use_decode_fast_path):
            out = orig_pad(self, num_q_tokens, max_kv_read, use_decode_fast_path)
            pads.append(((num_q_tokens, max_kv_read), out))
            return out

        monkeypatch.setattr(model_runner.ModelRunner, "maybe_pad_inputs", pad)
        monkeypatch.setattr(model_runner.ModelRunner, "run_one_warmup",
                            lambda self, *a, **k: (warmups.append(1), orig_warm(self, *a, **k))[1])
        made, replays, make = [], [], model_runner.create_accelerator_graph

        def create():
            graph = make()
            replay = graph.replay
            graph.replay = lambda: (replays.append(1), replay())[1]
            made.append(graph)
            return graph

        monkeypatch.setattr(model_runner, "create_accelerator_graph", create)
        run = run_workload(llama, cb=cb, **RUN)
    assert run.violations == [], run.report
    assert run.tokens == base.tokens and run.stats["forwards"] > 20
    assert made and len(replays) > len(made)  # (the engine's graphs were captured and replayed)
    assert warmups and any(out[0] > got[0] for got, out in pads), pads[:4]  # (the engine padded)
    assert rec.races() == [], [(a.op, a.stream, b.op, b.stream, r) for a, b, r in rec.races()[:5]]
    assert rec.memory is None or rec.memory.races() == []  # (every storage's accesses, named or not)


def test_a_fused_steps_graph_waits_for_the_forward_in_its_first_nodes(llama, monkeypatch, steady):
    # in_graph_waits (the default): the host records two events of the graph's own, the graph's first nodes
    # wait for them; planted: the wait nodes dropped (the host still waits for nothing eagerly)
    from hf_async_model import recorded_async

    from kvcanary.runtime.step.fused import FusedSteps

    waiting = []
    with recorded_async(monkeypatch) as rec:
        orig = FusedSteps._capture_waiting  # (the recording's)

        def capture_waiting(self, graph, body, side):
            waits = orig(self, graph, body, side)
            waiting.append(graph)
            graph.waits_on = ()  # the plant
            return waits

        monkeypatch.setattr(FusedSteps, "_capture_waiting", capture_waiting)
        run = run_workload(llama, cb=ASYNC, **RUN)
    assert waiting and run.violations == []  # (the CPU runs everything at once: only the recording sees it)
    races = {(a.op, b.op) for a, b, r in rec.races()}
    assert ("engine_forward", "stage") in races and ("engine_forward", "tail") in races, races


def test_the_next_rewrite_of_a_storage_set_waits_for_the_canary_work_that_read_it(llama, monkeypatch, steady):
    # planted: the step's done event dropped (transformers' H2D stream then waits for nothing of the canary's)
    from kvcanary.runtime.step import carry

    monkeypatch.setattr(carry.Carry, "done_event", lambda self: None)
    # (24 new tokens: with 16 the recording shows no rewrite racing the staging; measured, not derived)
    _, run, rec = _recorded_run(llama, monkeypatch, tokens=24, base=False)
    assert run.violations == []  # (the CPU runs everything at once: only the recording sees the race)
    races = {(a.op, b.op, r[0]) for a, b, r in rec.races()}
    assert races == {("stage", "h2d", "inputs")}, races


# One planted bug of each class the async carry-over could hide (Triton's interpreter: each run takes a while; every
# bug is planted without async in tests/test_transformers.py): a free, a read index, a history, the prefix key, a
# fork copy, a KV flip, a write into the trash. In the default run, those whose engine work async batching moves:
# a free at the update, the new token's read cell (its id carried over), the history one step behind, the fork copy
# at the update; the others are heavy extras (-m slow): their checks run the same kernels on the same fast paths.
ASYNC_BUGS = ["double-free", "new-token-read-index", "history-short", "skip-fork-copy"]
ASYNC_BUGS_SLOW = ["contiguous-read-index", "prefix-key-collision", "flip-kv", "never-written"]


@pytest.mark.parametrize("bug", ASYNC_BUGS + [pytest.param(b, marks=pytest.mark.slow) for b in ASYNC_BUGS_SLOW])
def test_planted_bugs_are_reported_under_async_with_the_fast_paths(llama, monkeypatch, steady, bug):
    # the engine's async IO, the canary's step graphs and fused steps: a planted bug is reported as without them
    # (tests/test_transformers.py), and the run's accesses stay ordered
    from hf_async_model import recorded_async

    with recorded_async(monkeypatch) as rec:
        run = run_workload(llama, bug=bug, cb=ASYNC, device="cpu", backend=RUN["backend"], max_new_tokens=6)
    assert run.violations, f"{bug}: nothing reported under async batching"
    assert rec.races() == []


def test_the_engines_reset_of_its_inputs_is_ordered_before_the_next_loops_copies(llama, monkeypatch, steady):
    # transformers resets both pairs' device inputs when a generation loop starts, on the caller's current
    # stream, which its own streams do not wait for; the canary's work holds that stream back (its waits for
    # the side stream), so the reset could land after the loop's first host-to-device copy. The adapter waits
    # for the reset; planted: that wait dropped, the recording lists the reset against the copies
    from kvcanary.runtime.patch import Patcher

    orig = Patcher.set
    monkeypatch.setattr(Patcher, "set", lambda self, obj, name, fn: None if name == "reset" else orig(self, obj, name, fn))
    _, run, rec = _recorded_run(llama, monkeypatch, memory=True, base=False)
    assert run.violations == []
    listed = {(storage.split(" ")[1], later) for storage, earlier, later in rec.memory.races()
              if storage.startswith("device ") and earlier.endswith("@engine")}
    assert ("write_index_storage", "copy_.default@h2d") in listed, rec.memory.races()


# Planted: both host-side shortcuts at once (the fence's wait dropped, a slot read as if known complete). Dropping
# waits only removes orderings, so a run ordered with both dropped is ordered with either alone: one run stands for
# the two plants (each was a run of its own, the same assertions). The clean run of the same configuration (the
# default: fused steps) is test_a_clean_async_run_is_clean_and_ordered[fused], with the same checks.
@pytest.mark.parametrize("planted", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["ordered", "fence-not-waited-and-slot-read-unwaited"])
def test_the_observers_slot_events_are_ordered_and_the_engines_sync_covers_their_shortcuts(llama, monkeypatch,
                                                                                          steady, planted):
    # The step's close as on CUDA (hf_async_model._cuda_observer): snapshot slots in pinned memory, each read by
    # the host once its event is known complete; a fused step's slot event also stands for its staging turn's copy
    # (SlotFence: the turn's next refill waits for it). A clean run is ordered per storage. The two host-side
    # shortcuts planted away (the fence's wait dropped; a slot read as if known complete) leave it ordered too:
    # transformers' host waits for each step's sampled tokens, which follow the compute stream's join of that
    # step's canary work, before it prepares the step that refills a turn or reads a slot. The shortcuts save CUDA
    # calls; under this engine they carry no ordering of their own.
    from kvcanary.runtime import observer as observer_mod
    from kvcanary.runtime.step import staging as staging_mod

    fenced, waits, unwaited = [], [], []
    orig_copied = staging_mod.Staging.copied
    monkeypatch.setattr(staging_mod.Staging, "copied",
                        lambda self, fence=None: (fenced.append(fence is not None), orig_copied(self, fence))[1])
    if planted:
        monkeypatch.setattr(observer_mod.SlotFence, "wait", lambda self: waits.append(1))
        orig_finish = observer_mod.HostObserver._finish

        def finish(self, slot, landed=False):
            unwaited.append(1)
            slot.known = slot.records
            return orig_finish(self, slot, landed)

        monkeypatch.setattr(observer_mod.HostObserver, "_finish", finish)
    base, run, rec = _recorded_run(llama, monkeypatch, memory=True)
    assert run.violations == [] and run.tokens == base.tokens
    assert any(fenced), "no fused step closed into a snapshot slot"
    assert not planted or (waits and unwaited), "a planted shortcut's code did not run"
    assert rec.races() == [] and rec.memory.races() == [], (rec.races()[:3], rec.memory.races()[:3])
