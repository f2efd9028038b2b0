"""Where the canary's host time goes inside transformers continuous batching: cProfile over its hooks.

Runs ``kvcanary.bench.engine`` with the given arguments (one round, no torch profiler) and profiles
only the canary's parts of each step (before/after the forward and its update bookkeeping), then
prints the functions with the most own time. On a GPU the kernel launches show up as the builtins
that enqueue them.

    python benchmarks/host_profile.py --device cuda --model-size 1b --batch 64 --context 2048
    python benchmarks/host_profile.py --device cpu --model-size tiny --batch 64 --context 512 --steps 16 \
        --stub-kernels --no-cprofile    # the canary's own Python per step, in the JSON it prints
    python benchmarks/host_profile.py --device cuda --model-size 1b --batch 1 --no-step-graphs --no-cprofile
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary.bench import engine as bench_engine  # noqa: E402

from kvcanary.integrations import hf_session  # noqa: E402
from kvcanary.runtime import launch  # noqa: E402


class _NoKernels:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def main(argv: list[str]) -> None:
    """Extra flags: --stub-kernels (the canary's own Python only: every op a no-op, so its health
    check complains of missing launches), --no-cprofile (time without the profiler's overhead),
    --no-step-graphs (the transformers adapter's steps all eager, as with attach(step_graphs=False))."""
    flags = ("--stub-kernels", "--no-cprofile", "--no-step-graphs")
    stub, plain, eager = (f in argv for f in flags)
    argv = [a for a in argv if a not in flags]
    if eager:
        hf_session.Session._step_graphs = lambda self, graph_type=None: None
    if stub:
        orig_init = launch.ForwardLauncher.__init__

        def init(self, canary):
            orig_init(self, canary)
            self.impl = _NoKernels()

        launch.ForwardLauncher.__init__ = init
    prof = cProfile.Profile()
    cls = hf_session.Session

    def profiled(fn):
        def run(self, *args):
            prof.enable()
            try:
                return fn(self, *args)
            finally:
                prof.disable()
        return run

    for name in () if plain else ("_before", "_after", "_before_update", "_after_update"):
        setattr(cls, name, profiled(getattr(cls, name)))
    bench_engine.main(argv + ["--rounds", "1", "--no-profile"])
    if plain:
        return
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats(os.environ.get("HOST_PROFILE_SORT", "tottime"))
    stats.print_stats(25)
    print(out.getvalue(), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
