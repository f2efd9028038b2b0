"""The attention-metadata check: the keys each query may attend, by the metadata the engine hands its attention
kernel, against the read index the canary verified (docs/write_check.md).

The record checks verify the slots a forward's read index lists. Attention reads keys through more than the
index: varlen kernels take per-request key lengths, SDPA and eager attention an explicit mask over the
concatenated keys of the whole batch. A mask not reset between batches, or a length off by some, lets a query
attend another request's keys (or hides its own) while every verified slot is right.

``AttentionCheck.check`` (``Canary.check_attention``) compares, for the open forward, the engine's cumulative
key lengths and mask of one group with the layout the batch's prefix and new-token counts imply
(``ops/attention_ops.py``): ``key_length`` and ``attention_mask`` rows, one per request at most, pushed into
the ring on the canary's side stream (the Triton backend: three kernel launches, ``ops/triton_attention.py``;
numba: one compiled loop on the host, ``ops/numba_attention.py``; else tensor ops, with no host read off the CPU).
Those launches read the engine's buffers by address, so a runner that records a step's work (``runtime/step``: the
captured and fused steps) records this check with it (``recorded``, the backend's recordable pass), and each replay
checks that step's metadata (``note_recorded`` counts it).
"""

from __future__ import annotations

from kvcanary.ops.api import resolve_backend
from kvcanary.ops.attention_ops import attention_impl, recordable_impl
from kvcanary.runtime.batch import ForwardBatch


class AttentionCheck:
    """The attention-metadata check of one ``Canary`` (``canary.attention_check``); idle with
    ``CanaryConfig.attention_check`` off."""

    def __init__(self, canary):
        self.c = canary
        self.on = bool(canary.config.attention_check) and canary.enabled
        # the backend's pass: Triton's kernels (the CUDA default), the scalar reference, else tensor ops
        backend = resolve_backend(canary.config.backend, canary.device)
        self.impl = attention_impl(backend)
        # a step's recorded work takes the same pass, except host loops (the reference's, numba's: no recording
        # holds them), where their tensor-op twin gives the same rows
        self.recorded_impl = recordable_impl(backend)
        self.checks = 0  # stats: calls that compared something

    def check(self, group: str = "full", *, cu_seqlens_k=None, mask=None, key_slots=None,
              batch: ForwardBatch | None = None) -> None:
        """Compare one group's attention metadata with the read index of ``batch`` (default: the open forward).

        Args:
            group: "full" or "swa" (its window: the canary's ``SwaSpec.window``).
            cu_seqlens_k: int [>= bs + 1] cumulative key lengths per request, as the kernel gets them.
            mask: [..., queries, keys] (leading dims of size 1): additive float (hidden = the dtype's lowest or
                -inf) or bool (True = attend); rows are the forward's tokens in batch order.
            key_slots: optional int [keys] the slot each key column reads (for the report).
        """
        if not self.on:
            return
        c = self.c
        batch = c._open if batch is None else batch
        if batch is None:
            raise RuntimeError(f"kv-canary: check_attention must run while a forward is open (between "
                               f"before_forward and after_forward), got none open at step {c.step}")
        # (a session whose steps replay from the CPU's stand-in graphs keeps host work out: the tensor ops)
        impl = self.impl if c.launcher.host_ops else self.recorded_impl
        if self._compare(impl, group, batch, cu_seqlens_k, mask, key_slots, False):
            self.checks += 1

    def recorded(self, batch: ForwardBatch, *, cu_seqlens_k=None, mask=None, key_slots=None,
                 batch_keys_only: bool = False) -> bool:
        """``check`` of the full-attention group, issued inside a step's recorded work (the step runner's
        captured and fused steps, ``StepRunner.record_attention``), which replays it each step: counted per step
        by ``note_recorded``, not here. ``batch_keys_only``: ``mask`` is wider than the keys the engine hands
        attention (its width a bucket), and only its columns before the batch's last key are compared. Returns
        whether anything was compared. (The backend's pass, the reference's tensor-op twin for the reference
        backend: its host loops cannot be recorded, and both give the same rows.)"""
        return self.on and self._compare(self.recorded_impl, "full", batch, cu_seqlens_k, mask, key_slots,
                                         batch_keys_only)

    def note_recorded(self) -> None:
        """A step whose recorded work holds this check ran (stats: it compared that step's metadata)."""
        self.checks += 1

    def _compare(self, impl, group: str, batch, cu_seqlens_k, mask, key_slots, batch_keys_only: bool) -> bool:
        c = self.c
        g = c._group(group)
        if mask is not None:
            if mask.dim() < 2 or any(d != 1 for d in mask.shape[:-2]):
                raise ValueError(f"kv-canary: check_attention mask must be [..., queries, keys] with leading "
                                 f"dimensions of 1, got shape {tuple(mask.shape)}")
            mask = mask.reshape(mask.shape[-2], mask.shape[-1])[:batch.num_tokens]
        if cu_seqlens_k is None and mask is None:
            return False
        with c.launcher.side():
            c.launcher.streams.note("attention_check", reads=("engine_inputs",), atomic=("ring",))
            impl(req_pool_indices=batch.req_pool_indices, prefix_lens=batch.prefix_lens,
                 extend_lens=batch.extend_lens, positions=batch.positions, request_ids=batch.request_ids,
                 window=g.window, cu_seqlens_k=cu_seqlens_k, mask=mask, key_slots=key_slots,
                 launch_tag=g.tag("head", "k"), ring=c.ring,
                 host_reads=c.device.type == "cpu" and c.launcher.host_ops, batch_keys_only=batch_keys_only)
        return True

    def attribution(self, row: list[int], step: int) -> dict:
        """What a report adds to an ``attention_mask`` / ``key_length`` row: the reading request (and position)."""
        return {"reader_request": row[5], "reader_position": row[2]}

    def stats(self) -> dict:
        return {"attention_checks": self.checks}
