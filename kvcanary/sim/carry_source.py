"""The simulated engine as an async-batching source (``SimEngine(..., steps=..., carry=True)``): its forward carries
the previous forward's sampled tokens over into its own input ids, as transformers' async batching does, so
the step runner's carrying path (``runtime/step/carry.py``) runs on the CPU.

What it models of that engine (docs/notes/async_batching.md, sections 1.2-1.4):

- **two input storage sets** that forwards use in turn (a step without a forward switches nothing), each with
  its own output ids (the sampled tokens of the forward that used it, in the batch's order; a last cell 0
  that an index of -1 reads) and carry indices;
- **the host one step behind**: a decode request that sampled a token in the previous forward is prepared
  before that token reaches the host, so its input id in the storage is the previous position's token (a
  plausible id, not a loud placeholder), its carry index points at that token in the other set's output ids,
  and its token history lacks the newest token (``SimSource._cells`` sends that cell one step later:
  ``carry.history_need``);
- **the carry-over inside the forward** (``forward_inputs``): the carried ids are written into the storage's
  input ids from the other set's output ids before the model reads them; then the "sampler" writes this
  forward's tokens into its set's output ids.

The sim's scheduler itself stays synchronous (its requests know every token): only what the source shows the
canary lags.
"""

from __future__ import annotations

import torch

from kvcanary.sim.step_source import SimSource

__all__ = ["CarrySource"]


class CarrySource(SimSource):
    """A ``SimSource`` whose forwards alternate two input storage sets and carry ids over (``carries``)."""

    carries = True

    def __init__(self, engine):
        super().__init__(engine)
        self.pairs = [self.inputs, self.new_inputs()]
        rows = engine.canary.max_batch + 1
        for io in self.pairs:
            io.output_ids = torch.zeros(rows, dtype=torch.int64)  # (the last cell stays 0: a -1 index reads it)
            io.carry_ids = torch.full_like(io.input_ids, -1)
            io.samplers = []  # (request, position) of the forward's sampled tokens, in output order
        self.current = 1  # the first forward takes set 0
        # per set: the runner's event after the canary work of the step that last read it, which the engine's
        # next rewrite of that set waits for (transformers: the H2D stream; here the inputs are host tensors,
        # so only a recording stream layer sees the wait: tests/test_async_steps.py)
        self.done = [None, None]
        self.carries_done = 0  # tokens carried over so far (tests: the path was taken)

    def set_step(self, works: list) -> None:
        """The next forward's inputs in the other storage set, as the host prepares them one step early."""
        self.current = 1 - self.current
        prev = self.pairs[1 - self.current]
        self.inputs = io = self.pairs[self.current]
        super().set_step(works)
        order = {r.rid: i for i, (r, _) in enumerate(prev.samplers)}
        carry, at = [-1] * sum(w.n for w in works), 0
        self.carried = set()
        for w in works:
            i = order.get(w.req.rid)
            if w.kind == "decode" and i is not None and w.start > 0:
                carry[at] = i
                # the host holds the previous position's token there (transformers: update(N-1) wrote it)
                io.input_ids[at] = w.req.token_at(w.start - 1)
                self.carried.add(w.req.rid)
            at += w.n
        io.carry_ids.fill_(-1)
        io.carry_ids[:at] = torch.tensor(carry, dtype=torch.int64)
        io.samplers = [(w.req, w.start + w.n) for w in works if w.kind == "decode" or (w.kind == "prefill" and w.final)]

    def forward_inputs(self, n: int):
        """The forward's inputs after its carry-over (the carried ids written from the other set's output ids),
        and this forward's sampled tokens in its set's output ids."""
        io, other = self.inputs, self.pairs[1 - self.current]
        carry = io.carry_ids[:n]
        ids = io.input_ids[:n]
        carried = carry >= 0
        ids.copy_(torch.where(carried, other.output_ids[carry.clamp(min=0)], ids))
        self.carries_done += int(carried.sum())
        model = self.engine.model
        tokens = [model.sample(r.rid, p) for r, p in io.samplers]
        io.output_ids[:len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        return super().forward_inputs(n)
