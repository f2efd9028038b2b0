"""Steps of an engine whose forward rewrites some of its own input ids on the device (``EngineSource.carries``).

An engine that prepares batch N+1 before batch N's tokens reach the host (transformers' async batching) writes
the ids it does not know yet inside forward N+1, from batch N's device outputs: the *carry-over*. Until then
the input storage holds a placeholder (in transformers, the previous position's token: plausible, not loud).
So under ``carries`` every step's canary work is late, and its HEAD reads the input ids after the forward:

- ``late_step`` is True whenever the canary is on (the ``late_hooks`` toggle cannot make it early); the step
  takes the path it allows once the forward is enqueued: eager on the engine's compute stream, captured or
  fused as a late step is;
- ``forward_enqueued`` (the engine calls it once the forward is enqueued): on CUDA the event ``ready`` that a
  late captured step's side stream waits for is recorded here, after the forward, not before it;
- ``done_event``: an event after the step's canary work, one per input storage set (the engine alternates two
  sets: each one's next host-to-device rewrite waits for the canary work of the step that last read it, not
  for the step in between).

What needs work before the forward cannot run: the token oracle (the sampler reads what the before work
computes), ``check_before_forward`` and fault injection are refused (``check``).

The host's token history lags one step as well: a carried request's newest token is on the device only when
the step is prepared. ``history_need`` is the rule both sources apply to the token cells they send.
"""

from __future__ import annotations

import torch

from kvcanary.runtime.streams import record_event

__all__ = ["Carry", "PairInputs", "check", "early_work", "history_need"]


def history_need(need: int, carried: bool) -> int:
    """The positions ``[0, n)`` of a request's token-table row a step sends and declares valid, of the ``need``
    its positions cover: under ``carries`` a request whose newest input id is carried over has that token on
    the device only (the engine's host learns it at the update after the step), so its cell waits one step
    (valid length ``need - 1``; the next step sends it, when that position is prefix and the plan verifies it).
    Every position is still checked, one step late; a second missing token stays an engine bug."""
    return need - 1 if carried else need


def early_work(oracle: bool, check_before_forward: bool, injecting: bool) -> list[str]:
    """The work a carrying source cannot run, by name: what must precede the forward (the adapter refuses it at
    attach with these names, ``check`` when the runner is made)."""
    return [name for name, on in (("token_oracle", oracle), ("check_before_forward", check_before_forward),
                                  ("fault injection", injecting)) if on]


def check(canary, source) -> None:
    """Raise ``ValueError`` for what a carrying source cannot run: work that must precede the forward."""
    early = early_work(source.oracle, canary.config.check_before_forward, canary.injector is not None)
    if early:
        raise ValueError(f"kv-canary: an engine whose forward carries input ids over (async batching) runs the "
                         f"canary's step after the forward, got {' and '.join(early)}, which must run before it; "
                         "turn them off or run the engine synchronously")


class Carry:
    """The ``StepRunner``'s side of a carrying source (``runner.carry``)."""

    def __init__(self, runner):
        self.s = runner
        check(runner.canary, runner.source)
        self.record_ready = False  # late_step asked for ``ready``: recorded by forward_enqueued
        self.done: dict = {}  # the input ids' data pointer (one per storage set) -> its done event

    def late_step(self) -> bool:
        """``StepRunner.late_step`` under ``carries``: late whenever the canary is on."""
        s = self.s
        c = s.canary
        s.ready = None
        self.record_ready = False
        if not c.enabled:
            return False
        if c.injector is not None:  # (set after the runner was made)
            check(c, s.source)
        # (after a fused step none is needed: see StepRunner.late_step; a fused step waits for the forward itself)
        self.record_ready = c.device.type == "cuda" and s.graphs is not None and not s.graphs.last_fused
        return True

    def forward_enqueued(self) -> None:
        """The engine enqueued the step's forward (the carry-over included) on its compute stream: a late captured
        step's side stream starts after it (``ready``)."""
        if not self.record_ready:
            return
        self.record_ready = False
        s = self.s
        stream = s.source.inputs.compute_stream
        if stream is None:
            return
        if s._ready_event is None:
            s._ready_event = torch.cuda.Event()
        record_event(s._ready_event, stream)
        s.ready = s._ready_event

    def done_event(self):
        """After the step's after work: an event on the canary's side stream (or the engine's compute stream
        without one) that follows all the canary work issued so far, on the side, current and compute streams;
        one event per input storage set. The engine makes its next rewrite of that set wait for it. None on the
        CPU's inline stream layer (nothing runs beside anything)."""
        s = self.s
        streams = s.canary.launcher.streams
        io = s.source.inputs
        compute = io.compute_stream
        here = streams.current()
        at = streams.side() or compute or here
        if at is None:  # (the CPU's inline layer: nothing runs beside anything)
            return None
        for other in (here, compute):
            if other is not None and not streams.same(other, at):
                streams.wait(at, streams.record(other))
        if s.device.type != "cuda":
            return streams.record(at)  # (the recording fake's event: tests/test_async_steps.py)
        key = io.input_ids.data_ptr()
        ev = self.done.get(key)
        if ev is None:
            ev = self.done[key] = torch.cuda.Event()
        record_event(ev, at)
        return ev


class PairInputs:
    """The ``StepInputs`` of one of an engine's two input storage sets (async batching): the storages and sizes
    of the set's device half, the requests of its host half (``requests_in_batch``: the device half never gets
    them) and the engine's one compute stream, which serves both sets. A source hands the runner the view of
    the set its current step uses, while that step runs (the engine switches sets once the forward is
    enqueued)."""

    def __init__(self, device, host, compute_stream):
        self._device, self._host, self.compute_stream = device, host, compute_stream

    @property
    def requests_in_batch(self) -> list:
        return self._host.requests_in_batch

    def __getattr__(self, name: str):  # (the storages and sizes: the device half's, as they are now)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._device, name)
