"""The after work of a captured step that is not fused: recorded in the runner's plans, replayed, closed in one place.

A captured step (``graphs.StepGraphs``) replays its before work from a recording; its after work is the
``Canary``'s ``device_after`` (TAIL verify and write with the real-KV hash, the device step, the non-finite KV
check, the write check) and the step's snapshot copy into its slot (``HostObserver.take_slot``), then the step's
close (``Canary.close_step``). ``AfterPlans`` records that work in plans of the runner's own (``plans.Plans``), as
``fused.FusedSteps`` records a fused step's whole work: eager for a key's first ``EAGER_SIGHTINGS`` steps (the
first compiles the Triton kernels and warms the allocator), then captured once and replayed.

The key: what the after work reads is the launcher's inputs as the step's before work left them
(``ForwardLauncher.state``, which a replayed before plan restores), the canary's static buffers and the KV. On
CUDA those inputs are views of the canary's one staged buffer, laid out by the launcher's key: the step key's
requests and new tokens (``StepKey.bs``, ``T``) and which optional fields are staged. Elsewhere (the CPU
stand-in) they are the step's batch tensors, whose addresses join the key. So the after key is that, not the
whole step key: the many read-table widths, token cells and staging turns of one (bs, T) share one recording.
The snapshot copy has a recording per slot (``("snapshot", slot)``: three in all); a key that has closed
``COMBINE_SIGHTINGS`` steps gets one recording of both per slot instead (one replay per step instead of two, for
a capture per slot, which only a shape that keeps coming back repays: prefill chunks and a shrinking batch's
decode shapes stay apart). A CUDA graph keeps no tensor alive: a plan keeps the launcher's inputs its
recording reads (``Plan.keep``).

Streams, on the two routes of a captured step (``StepGraphs.after``):

- a steady decode step replayed inline (``StepGraphs._inline``: on the stream the engine prepared its inputs
  on): its after work runs there too, inside ``ForwardLauncher.run_here`` (that stream waits for the forward
  first, TAIL hashing the KV it wrote; the compute stream waits for it after, so its next forward and every
  later KV write come after TAIL's reads);
- any other captured step (``StepGraphs._general``, its before work on the canary's side stream): on the
  engine's compute stream, whose position after the forward the side stream waits for (``launcher.side()``);
  the side stream runs the after work behind the step's before work queued there, and the compute stream joins
  it at once (``launcher.join``), as ``Canary.after_forward`` does. That pending side work is then no work of
  the close's own (``Canary.plain_close(on_side=True)``).

On CUDA a capture goes to the canary's side stream (the hook's own stream may be the legacy default stream,
which cannot capture; a capture runs nothing, so it needs no ordering), into the plans' own memory pool: after
replays run one at a time (each route's compute stream joins it before the next step's canary work starts).

An eager step of the same runner (one its graphs cannot take: the block-table path, a sliding-window group, the
token oracle) records its after work in these plans too, where the launcher staged its inputs (CUDA): its
``before_forward`` left its HEAD on the side stream, and ``on_side`` follows it there (``takes_eager``).

Where the step's close has work of its own (a sweep or an allocator check due, fault injection:
``Canary.plain_close``), the recorded ``device_after`` is followed by ``Canary.host_after`` (the eager close:
that work, then the snapshot), which is what ``after_forward`` adds to ``device_after``.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from kvcanary.runtime.graphs import capture, eager, replay_of
from kvcanary.runtime.observer import COMBINE_SIGHTINGS  # (a key's TAIL and snapshot copy as one recording after it)
from kvcanary.runtime.step.plans import Plan, Plans
from kvcanary.runtime.streams import capturing

EAGER_SIGHTINGS = 1  # an after key's steps run eagerly before its capture (as a before plan's: graphs.py)
MAX_AFTER = 32  # recordings kept: a few (bs, T) keys, the three snapshot slots, the combined ones per slot


class AfterPlans:
    """The recorded after work of one runner's captured, unfused steps (``StepGraphs``) and their close."""

    def __init__(self, graphs):
        self.g, self.s = graphs, graphs.s
        # (under carries on the CPU stand-in, the batch's addresses of two input storage sets: twice as many keys)
        self.plans = Plans(2 * MAX_AFTER if self.s.carries else MAX_AFTER)
        self.pool = graphs.new_pool()  # (their own: see the module's docstring)
        self.cuda = graphs.graph_type is torch.cuda.CUDAGraph
        self.captures = self.replays = 0

    def takes_eager(self) -> bool:
        """Whether the after work of an eager step of this runner (its before work the ``Canary``'s own
        ``before_forward`` on the engine's stream) may come from these plans too: its forward is open, the
        launcher staged its inputs (a side stream: CUDA), no fault injection (its hooks run around the eager
        close) and the engine is not capturing a CUDA graph of its own (the canary's work goes into that one)."""
        c = self.s.canary
        return (c.launcher.staged_now and c.open_batch is not None and c.injector is None
                and not (c.device.type == "cuda" and capturing()))

    def here(self, batch) -> None:
        """The after work and close of an inline step (``ForwardLauncher.run_here``: on the current stream)."""
        self._after(batch, on_side=False)

    def on_side(self, batch) -> None:
        """The after work and close of a step whose before work ran on the side stream, called on the engine's
        compute stream after the forward: on the side stream after both, joined by the compute stream."""
        launcher = self.s.canary.launcher
        try:
            with launcher.side():
                self._after(batch, on_side=True)
        finally:  # (a violation raised in mode "raise" too: the engine stream joins what was issued)
            launcher.join()

    def _after(self, batch, on_side: bool) -> None:
        c = self.s.canary
        plain = c.plain_close(on_side=on_side)
        obs = c.monitor.observer
        slot, done = None, ()
        if plain and not obs.eager_read:
            slot, done = obs.take_slot()  # (the observation it held is read before the copy overwrites it)
        t0 = time.perf_counter()
        self._device(batch, slot, obs)
        launch_s = time.perf_counter() - t0
        if plain:
            c.close_step(batch, slot, done, launch_s)
        else:
            c.host_after(batch)  # (its own work, then the snapshot: the eager close)

    def _device(self, batch, slot, obs) -> None:
        """``device_after`` and, with ``slot``, the snapshot copy into it: eager, captured or replayed."""
        c = self.s.canary
        launcher = c.launcher
        key = launcher.key if launcher.staged_now else launcher.key + _addresses(launcher.inputs)
        seen = self.plans.seen(key)
        if seen <= EAGER_SIGHTINGS:
            c.device_after(batch)
            if slot is not None:
                obs.copy_into(slot, eager)
            return
        if slot is not None and seen > COMBINE_SIGHTINGS:
            def both():
                c.device_after(batch)
                obs.copy_into(slot, eager)
            self._replay((key, slot.key[1]), both)
            return
        self._replay(key, lambda: c.device_after(batch))
        if slot is not None:
            self._replay(slot.key, lambda: obs.copy_into(slot, eager))

    def _replay(self, key, body) -> None:
        """Replay the plan of ``key``, captured from ``body()`` first if there is none."""
        p = self.plans.get(key)
        if p is not None:
            p.replay()
            self.replays += 1
            return
        launcher = self.s.canary.launcher
        p = Plan(None)
        graph = self.g.graph_type()
        # a CUDA capture runs nothing: on the side stream, which is never the legacy default stream (that one
        # cannot capture); the CPU stand-in's capture runs the work: where its replays run
        side = launcher.streams.side() if self.cuda else None
        with nullcontext() if side is None else launcher.streams.use(side):
            capture(graph, body, pool=self.pool)
        p.graph, p.replay, p.keep = graph, replay_of(graph), launcher.state()
        self.plans.add(key, p)  # (a dropped plan's graph goes with it)
        self.captures += 1
        graph.replay()  # a capture records the calls without running them


def _addresses(x) -> tuple:
    """The addresses of the launcher's inputs ``x`` where they are the batch's own tensors (not staged)."""
    return tuple(0 if t is None else t.data_ptr()
                 for t in (x.input_ids, x.positions, x.writer_ids, x.exp_ids, x.exp_pos, *x.loc))
