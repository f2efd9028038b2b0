"""An engine forward that failed between the hooks: the canary's open forward is abandoned, not left open.

An engine's forward may raise after ``before_forward`` (an out-of-memory error, a kernel that fails, the
engine's own assert), and the engine may serve on (a later generation, a retry). Left open, the forward
would make every later ``before_forward`` raise ("a second before_forward"); closed as if it ran, it
would certify KV that was never written. ``abandon`` (``Canary.abandon_forward``, and the adapter's wrap
of the engine's step) does neither:

- the forward is closed without a step: the step counter, the stats and the device step stay where they
  were, and the next ``before_forward`` starts a new forward;
- what HEAD found in the forward's reads (its verify rows in the ring) is drained as that forward's own
  observation, with its batch for reader attribution (a device sync on CUDA: the rare path);
- HEAD's records of the forward's new tokens are taken back: their HEAD records become the TAIL
  records again (what the last completed writes certified, or empty). The forward may never have written
  that KV: a later read of those slots fails TAIL's checks (the record holds another token, position or
  chain, or none: "never written") and HEAD's as well (the new tokens' read check, ``check_before_forward``),
  the next write after them fails the chain-position assert, and no TAIL write hashed bytes the forward may
  have left half-written. A retry of the same forward writes the same records again.

Nothing else of the forward stays: the launcher's side-stream work is joined, a deferred TAIL dropped, the write
check's notes of the forward forgotten (the next forward's writes are compared with its own layers' KV only).
"""

from __future__ import annotations

import torch

__all__ = ["abandon"]


def abandon(canary, drain: bool = True) -> None:
    """Abandon ``canary``'s open forward (nothing open: nothing to do). ``drain``: read what HEAD found as
    the forward's observation (``check_reads_now`` has read it already when it abandons)."""
    batch = canary._open
    if batch is None:
        return
    canary._open = None  # first: whatever follows raises, the canary stays usable
    launcher = canary.launcher
    launcher.deferred, launcher.checked = None, None
    launcher.join()  # the current stream after HEAD's launches (its write, its verify's ring rows)
    if canary.device.type == "cuda":
        torch.cuda.synchronize(canary.device)  # (an adapter may have replayed its before work on a stream of its own)
    _take_back_head_writes(canary, batch)
    canary.write_check.forget()
    if drain:
        canary.monitor.drain_open(batch, canary.step + 1)


def _take_back_head_writes(canary, batch) -> None:
    """The HEAD records of the open forward's new tokens (the real requests': padding writes nothing) become the
    TAIL records again, per group and K/V buffer, at the slots HEAD wrote (the launcher's, an SWA group's
    translated)."""
    inputs = getattr(canary.launcher, "inputs", None)
    if inputs is None:
        return
    rows, extend = batch.req_pool_indices, batch.extend_lens
    real = int(extend[:rows.shape[0]][rows != 0].sum())  # (padding requests come after every real one)
    for g, loc in zip(canary.groups, inputs.loc):
        slots = loc[:real].to(torch.int64)
        slots = slots[(slots >= 0) & (slots < g.num_slots)]
        if not slots.shape[0]:
            continue
        for kv in g.kvs:
            head, tail = g.bufs["head", kv], g.bufs["tail", kv]
            head[slots] = tail[slots]
