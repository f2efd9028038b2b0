"""Where the canary's host time goes inside transformers continuous batching: cProfile over its hooks.

Runs ``kvcanary.bench.engine`` with the given arguments (one round, no torch profiler) and profiles
only the canary's hooks around the forward of each steady decode step (same batch as the step before,
one new token per request), then
prints the functions with the most own time. On a GPU the kernel launches show up as the builtins
that enqueue them.

    python benchmarks/host_profile.py --device cuda --model-size 1b --batch 64 --context 2048
    python benchmarks/host_profile.py --device cpu --model-size tiny --batch 64 --context 512 --steps 16 \
        --stub-kernels --no-cprofile    # the canary's own Python per step, in the JSON it prints
    python benchmarks/host_profile.py --device cuda --model-size 1b --batch 1 --no-step-graphs --no-cprofile
    python benchmarks/host_profile.py --device cuda --model-size 1b --batch 64 --timers
        # inclusive wall time per call of each hook part over steady decode steps, no cProfile
    python benchmarks/host_profile.py --device cuda --model-size 1b --batch 64 --count-calls
        # Python and C calls per steady decode step inside the hooks (the update's too)
    TRITON_INTERPRET=1 python benchmarks/host_profile.py --device cpu --model-size tiny --batch 8 --context 64 \
        --steps 40 --canary-option backend=triton --stand-in-graphs --count-calls
        # the same count for the CUDA-graph paths, on the CPU (use_stand_in_graphs)
    TRITON_INTERPRET=1 python benchmarks/host_profile.py --device cpu --model-size tiny --batch 8 --context 512 \
        --mode prefill --chunk 128 --canary-option backend=triton --stand-in-graphs --count-calls --chunks
        # the same for a prefill's chunks (every multi-token step, its captures and first sightings included)
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary.bench import engine as bench_engine  # noqa: E402

from kvcanary.integrations.transformers import session as hf_session  # noqa: E402
from kvcanary.runtime import launch  # noqa: E402


class _NoKernels:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


_TIMED = {
    "kvcanary.integrations.transformers.session:Session": ("_before", "_after", "_before_update", "_after_update"),
    "kvcanary.runtime.step.runner:StepRunner": ("before", "after", "engine_stream", "late_step", "join"),
    "kvcanary.runtime.step.tables:StepTables": ("build", "fill_read_table", "verify_new_reads"),
    "kvcanary.integrations.transformers.batch:BatchBuilder": ("host_part", "_rows", "_token_cells", "forget_finished", "_steady"),
    "kvcanary.runtime.step.staging:Staging": ("send", "copied"),
    "kvcanary.runtime.step.graphs:StepGraphs": ("before", "_run", "after"),
    "kvcanary.runtime.step.after:AfterPlans": ("_device", "_replay"),
    "kvcanary.runtime.step.fused:FusedSteps": ("step", "repeat", "_launch", "_capture", "_replay", "usable", "join"),
    "kvcanary.runtime.canary:Canary": ("host_before", "after_forward", "device_after", "host_after",
                                       "close_step", "check_replayed"),
    "kvcanary.runtime.launch:ForwardLauncher": ("join", "side"),
    "kvcanary.runtime.monitor:Monitor": ("poll", "close_step"),
    "kvcanary.runtime.graphs:CudaGraphs": ("run",),
    "kvcanary.runtime.observer:HostObserver": ("snapshot", "collect", "take_slot", "taken"),
    "kvcanary.runtime.streams:CudaStreams": ("record", "wait", "use"),
}
_CALLS: dict[str, list[float]] = {}


def profile_while(fn, prof: cProfile.Profile, active):
    """The method ``fn`` run under ``prof`` whenever ``active()`` holds (then plainly)."""
    def run(self, *args):
        if not active():
            return fn(self, *args)
        prof.enable()
        try:
            return fn(self, *args)
        finally:
            prof.disable()
    return run


_STEADY = [False]  # the current step is a steady decode step (_steady): the only steps timed or profiled
STEADY_AFTER = 20  # canary steps before a decode step counts as steady (kernels compiled, graphs captured)


_KIND = ["decode"]  # --chunks: multi-token steps (prefill chunks) instead of steady decode steps


def _steady(session) -> bool:
    """One new token per request, same batch as the step before, and past the first steps (``--chunks``: a
    step with more new tokens than requests, from the session's first on: a prefill call's steps)."""
    io = session.bp.inputs_and_outputs
    reqs = io.requests_in_batch
    if _KIND[0] == "chunks":
        return sum(fs.query_length for fs in reqs) > len(reqs)
    names = [fs.state.request_id for fs in reqs]
    last, session._profile_names = getattr(session, "_profile_names", None), names
    return (session.canary.step > STEADY_AFTER and names == last
            and all(fs.query_length == 1 for fs in reqs))


def torch_cuda_sync():
    """HOST_PROFILE_SYNC=1: the device is synchronized before each timed hook (outside its time), so a
    part that waits for the engine's kernels shows as a drop against an unsynchronized run."""
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else None


def _mark_steady() -> None:
    """Wrap the hooks so only steady decode steps are timed or profiled (the generation's prefill
    chunks and shape changes would mix captures and compilation into the medians)."""
    cls = hf_session.Session
    orig_before, orig_after, orig_update = cls._before, cls._after, cls._after_update

    sync = os.environ.get("HOST_PROFILE_SYNC") == "1" and torch_cuda_sync()

    def before(self):
        _STEADY[0] = _steady(self)
        if _STEADY[0] and sync:
            sync()
        return orig_before(self)

    def after(self):
        if _STEADY[0] and sync:
            sync()
        return orig_after(self)

    def after_update(self, snap):
        try:
            return orig_update(self, snap)
        finally:
            _STEADY[0] = False  # (the step ends with the engine's update: its hooks are timed too)
    cls._before, cls._after, cls._after_update = before, after, after_update


def _install_timers() -> None:
    """Wrap each part above with a wall-clock timer (about 0.3 us per call of its own)."""
    import importlib
    import time

    for where, names in _TIMED.items():
        mod, cls = where.split(":")
        owner = getattr(importlib.import_module(mod), cls)
        for name in names:
            fn = getattr(owner, name)
            label = f"{cls}.{name}"
            calls = _CALLS.setdefault(label, [])

            def timed(*args, _fn=fn, _calls=calls, **kwargs):
                if not _STEADY[0]:
                    return _fn(*args, **kwargs)
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    _calls.append(time.perf_counter() - t0)
            setattr(owner, name, timed)


_COUNTS: dict[str, list[int]] = {"python": [], "c": []}
_BY_FUNC: list[dict[str, int]] = []  # per step (HOST_PROFILE_BY_FUNC=1)
_ALLOCATING = frozenset(("empty", "empty_like", "zeros", "zeros_like", "full", "arange", "tensor", "clone",
                         "Tensor.clone", "Tensor.to", "Tensor.contiguous", "cat", "stack"))


def _install_counter() -> None:
    """--count-calls: Python function calls and C calls (builtins, C methods) made inside the canary's
    hooks on steady decode steps, per step: a count that does not move with the host's load, where
    inside the engine's step each call costs microseconds (cold caches)."""
    from kvcanary.runtime.graphs import DispatchGraph, _Recorded

    cls = hf_session.Session
    counts = [0, 0]
    # a CPU stand-in's replay (tests' graphs) runs its recorded calls in Python: one call, as a CUDA replay
    replays = {DispatchGraph.replay.__code__, _Recorded.replay.__code__}
    try:  # under TRITON_INTERPRET=1 a launch runs the kernel in Python: one call, as a launch on a GPU
        from triton.runtime.interpreter import GridExecutor

        replays.add(GridExecutor.__call__.__code__)
    except ImportError:
        pass
    inside = [0]
    # HOST_PROFILE_BY_FUNC=1: the calls by function too (Python: file:line(name); C: its qualified name)
    by_func = {} if os.environ.get("HOST_PROFILE_BY_FUNC") == "1" else None

    def tracer(frame, event, arg):
        if inside[0]:
            if event == "call":
                inside[0] += 1
            elif event == "return":
                inside[0] -= 1
        elif event == "call":
            counts[0] += 1
            if frame.f_code in replays:
                inside[0] = 1
            if by_func is not None:
                code = frame.f_code
                k = f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}({code.co_name})"
                if code.co_name == "_launch" and "fn" in frame.f_locals:  # (which kernel)
                    k += f" {getattr(frame.f_locals['fn'], '__name__', frame.f_locals['fn'])}"
                by_func[k] = by_func.get(k, 0) + 1
        elif event == "c_call":
            counts[1] += 1
            if by_func is not None:
                k = getattr(arg, "__qualname__", str(arg))
                if k in _ALLOCATING:  # (who allocates: a device allocation may stall the engine's streams)
                    k += f" <- {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
                by_func[k] = by_func.get(k, 0) + 1

    def counted(fn, last):
        def run(self, *args):
            if not _STEADY[0]:
                return fn(self, *args)
            sys.setprofile(tracer)
            try:
                return fn(self, *args)
            finally:
                sys.setprofile(None)
                if last:
                    _COUNTS["python"].append(counts[0])
                    _COUNTS["c"].append(counts[1])
                    if by_func is not None:  # (a step's tally: _print_counts keeps the typical steps')
                        _BY_FUNC.append(dict(by_func))
                        by_func.clear()
                    counts[0] = counts[1] = 0
        return run

    for name in ("_before", "_after", "_before_update", "_after_update"):
        setattr(cls, name, counted(getattr(cls, name), name == "_after_update"))


def _print_counts() -> None:
    import statistics

    print(f"{'steady decode' if _KIND[0] == 'decode' else 'multi-token'} steps counted: {len(_COUNTS['python'])}",
          file=sys.stderr)
    for kind, n in _COUNTS.items():
        if n:
            print(f"{kind} calls per step: median {statistics.median(n):.0f}, min {min(n)}, max {max(n)}, "
                  f"total {sum(n)}", file=sys.stderr)
    if _BY_FUNC:  # the steps within twice the median count (compiles and captures apart): calls per step
        cap = 2 * statistics.median(_COUNTS["python"])
        typical = [t for t, n in zip(_BY_FUNC, _COUNTS["python"]) if n <= cap]
        total: dict[str, int] = {}
        for t in typical:
            for k, n in t.items():
                total[k] = total.get(k, 0) + n
        print(f"by function, over the {len(typical)} steps within twice the median:", file=sys.stderr)
        for k, n in sorted(total.items(), key=lambda kv: -kv[1])[:int(os.environ.get("HOST_PROFILE_TOP", "45"))]:
            print(f"{n / len(typical):9.1f}  {k}", file=sys.stderr)


def _print_timers() -> None:
    """Median and 90th percentile inclusive microseconds per call over the steady decode steps
    (``_steady``), and the calls per ``Session._before``."""
    import statistics

    steps = max(1, len(_CALLS.get("Session._before", ())))
    print(f"steady decode steps timed: {steps}", file=sys.stderr)
    print(f"{'part':34s} {'calls/step':>10s} {'median us':>10s} {'p90 us':>10s}", file=sys.stderr)
    for label, calls in _CALLS.items():
        if not calls:
            continue
        p90 = sorted(calls)[int(0.9 * (len(calls) - 1))]
        print(f"{label:34s} {len(calls) / steps:10.2f} {statistics.median(calls) * 1e6:10.1f} "
              f"{p90 * 1e6:10.1f}", file=sys.stderr)


def use_stand_in_graphs() -> None:
    """--stand-in-graphs: on the CPU, the adapter's CUDA-graph paths (step graphs, fused steady steps) with the
    CPU stand-in of a CUDA graph, as the tests run them; with --count-calls, the Python and C calls of those
    paths per steady step, counted on any machine (each replay counts as one call). Needs the Triton backend
    under the interpreter (``--canary-option backend=triton``, TRITON_INTERPRET=1): the stand-in records
    Triton launches and torch ops, not numba calls."""
    from kvcanary.runtime.step import graphs as hf_graph
    from kvcanary.runtime.graphs import DispatchGraph

    orig = hf_session.Session._step_runner
    hf_session.Session._step_runner = lambda self, graph_type=None: orig(self, DispatchGraph)
    hf_graph.STEADY_SIGHTINGS = 2  # (a short CPU run reaches the fused steps soon)


def main(argv: list[str]) -> None:
    """Extra flags: --stub-kernels (the canary's own Python only: every op a no-op, so its health
    check complains of missing launches), --no-cprofile (time without the profiler's overhead),
    --no-step-graphs (the transformers adapter's steps all eager, as with attach(step_graphs=False)),
    --stand-in-graphs (use_stand_in_graphs), --chunks (count, time or profile the multi-token steps, a prefill's
    chunks, first sightings and captures included, instead of steady decode steps)."""
    flags = ("--stub-kernels", "--no-cprofile", "--no-step-graphs", "--timers", "--count-calls", "--stand-in-graphs",
             "--chunks")
    stub, plain, eager, timers, count, stand_in, chunks = (f in argv for f in flags)
    if chunks:
        _KIND[0] = "chunks"
    plain = plain or timers or count
    if timers:
        _install_timers()
    if count:
        _install_counter()
    argv = [a for a in argv if a not in flags]
    if eager:
        from kvcanary.runtime.engine import StepOptions
        from kvcanary.runtime.step import StepRunner

        hf_session.Session._step_runner = lambda self, graph_type=None: StepRunner(
            self.canary, self.builder, dataclasses.replace(StepOptions.of(self.handle.options), step_graphs=False))
    if stand_in:
        use_stand_in_graphs()
    if stub:
        orig_init = launch.ForwardLauncher.__init__

        def init(self, canary):
            orig_init(self, canary)
            self.impl = _NoKernels()

        launch.ForwardLauncher.__init__ = init
    prof = cProfile.Profile()
    cls = hf_session.Session

    for name in () if plain else ("_before", "_after"):
        setattr(cls, name, profile_while(getattr(cls, name), prof, lambda: _STEADY[0]))
    _mark_steady()
    bench_engine.main(argv + ["--rounds", "1", "--no-profile"])
    if timers:
        _print_timers()
    if count:
        _print_counts()
    if plain:
        return
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats(os.environ.get("HOST_PROFILE_SORT", "tottime"))
    stats.print_stats(25)
    print(out.getvalue(), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
