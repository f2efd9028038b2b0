"""Reserved, poisoned and non-finite slots, reads past a length: checks beside the record ops (docs/slots.md).

The verify op skips slot 0 (SPEC 4.4: the padding slot), so a live token whose table cell is 0
reads the padding slot's KV unseen, and a chain check whose predecessor cell is 0 is skipped too.
Records say nothing about KV that is not finite, and a slot freed but never reused still holds a
matching record and intact bytes, so a read of it after its free passes. ``SlotChecks`` adds:

- reserved slots (``reserved_check``): at HEAD, every prefix entry of the plan (and an adapter's own
  read entries, ``check_entries``) and every live token's write slot is tested against a mask of
  slot 0 and ``PoolSpec.reserved_slots``: ``reserved_slot_read`` / ``reserved_slot_write``;
- non-finite KV (``nonfinite_check``): at TAIL, the bytes each live token wrote into every floating
  real-KV source are tested for NaN/Inf (an exponent of all ones, read on integer views, so any
  IEEE width works): one ``nonfinite_kv`` row per forward, for its first such token and source;
- poison on free (``poison_on_free``): ``poison_slots`` fills freed slots' bytes in every real-KV
  source of the full group with ``POISON``, NaN in every float format; a later read fails its
  real-KV check at TAIL, and the report recognises the pattern (``Violation.poisoned``);
- reads past the batch's length (always on): an adapter whose engine lists more read-index cells than the
  batch's live positions (``read_past_length``, from host numbers the adapter has: the step runner's
  ``StepTables.check_read_length``) pushes one ``read_past_length`` row for the forward.

Findings are violation rows appended to the canary's ring, on the stream HEAD and TAIL append to,
from static buffers only (no host sync on an accelerator), so they are drained, logged, counted
and raised with every other violation. Row layouts are in docs/slots.md.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.format import FailReason
from kvcanary.ops.api import resolve_backend
from kvcanary.ops.slot_ops import EXPONENT, NO_HIT, NONFINITE, READ, byte_cells, slot_impl
from kvcanary.ops.torch_ops import _push
from kvcanary.runtime.checks import slots_tensor

# The poison: little-endian 16-bit words 0x7FF5, a NaN in float16, bfloat16, float32 and float64 alike (each
# width's exponent bits all ones, a non-zero mantissa), with a payload no arithmetic produces: a computed NaN
# is 0x7FC0... or carries its inputs' payload (CPU float32 NaNs may come out as all ones), so the pattern
# tells a freed slot from a NaN the model made.
POISON = (0xF5, 0x7F)  # (even bytes, odd bytes)
READ_PAST = int(FailReason.READ_PAST_LENGTH)
_NP_INT = {2: np.int16, 4: np.int32, 8: np.int64}


class SlotChecks:
    """The slot checks of one ``Canary`` (``canary.slots``); each is off when its config field is (the
    read-length report, ``read_past_length``, is always on)."""

    def __init__(self, canary):
        self.c = canary
        cfg, pool, g = canary.config, canary.pool, canary.groups[0]
        self.reserved = None
        if cfg.reserved_check:
            self.reserved = torch.zeros(pool.num_slots, dtype=torch.bool, device=canary.device)
            self.reserved[[0, *pool.reserved_slots]] = True
        # CPU: numpy views answer "anything to report?" in microseconds; the tensor path runs only when yes
        self._cpu = canary.device.type == "cpu"
        self._reserved_np = self.reserved.numpy() if self._cpu and self.reserved is not None else None
        # (kv, index, source) of the full group's sources whose dtype is a float format
        self.float_sources = [(kv, i, s) for kv in ("k", "v") for i, s in enumerate(g.sources[kv])
                              if s.tensor.dtype in EXPONENT] if cfg.nonfinite_check else []
        if self.float_sources:
            self._tags = torch.tensor([g.tag("tail", kv) for kv, _, _ in self.float_sources], device=canary.device)
            self._index = torch.tensor([i for _, i, _ in self.float_sources], device=canary.device)
            self._first = torch.full((1,), NO_HIT, dtype=torch.int64, device=canary.device)  # (Triton's scratch)
            self._sources = [src for _, _, src in self.float_sources]  # (the device pass's argument, made once)
        # the device passes: a kernel or two per check with Triton, tensor ops otherwise (ops/slot_ops.py)
        self.ops = slot_impl(resolve_backend(cfg.backend, canary.device))
        if self._cpu:  # (numpy views of the static buffers the checks read, made once)
            self._offs_np, self._count_np = g.plan.write_offsets.numpy(), g.plan.entries.count.numpy()
            self._slot_np = g.plan.entries.slot.numpy()
            # each source's KV as [rows, page_size, words] of same-width ints: a slot's words are one gather
            self._rows_np = [src.byte_rows().numpy().view(_NP_INT[src.tensor.dtype.itemsize]).reshape(
                src.tensor.shape[0], src.page_size, -1) for _, _, src in self.float_sources]
        self.poison_on = cfg.poison_on_free
        self.poisoned_count = 0  # slots poisoned so far (stats)

    # -- HEAD: reserved slots ------------------------------------------------------------------------
    def before(self) -> None:
        """The plan's prefix entries and the live tokens' write slots against the reserved mask (after the
        launcher's ``before``, on its side stream: the plan and staged inputs are ready there)."""
        if self.reserved is None:
            return
        c = self.c
        with c.launcher.side():
            g = c.groups[0]
            loc, x = c.launcher.inputs.loc[0], c.launcher.inputs
            if self._host():  # (the common case in microseconds: nothing reserved among the reads and writes)
                written = int(self._offs_np[c.launcher.key[0]])
                read = self._slot_np[:max(0, min(int(self._count_np[0]), self._slot_np.shape[0]))]
                if not self._any_reserved(read) and not self._any_reserved(loc.numpy()[:written]):
                    return
            tag = g.tag("head", "k")
            c.launcher.streams.note("reserved_check", reads=("plan", "staged"), atomic=("ring",))
            self.check_entries(g.plan.entries, tag, c.launcher.entry_bound)
            self.ops.reserved_writes(out_cache_loc=loc, write_offsets=g.plan.write_offsets,
                                     num_requests=c.launcher.key[0], positions=x.positions, input_ids=x.input_ids,
                                     writer_ids=x.writer_ids, reserved=self.reserved, ring=c.ring, launch_tag=tag,
                                     host_reads=self._host())

    def check_entries(self, entries, launch_tag: int, bound: int | None = None) -> None:
        """Report entries (read slots) that name a reserved slot: the verify op skips slot 0 silently. An
        adapter that verifies read entries of its own (new tokens' read cells) calls it after that verify.
        ``bound``: at most this many entries are filled (the device pass looks at no more than these)."""
        if self.reserved is None:
            return
        if self._host():  # (the count is free to read there)
            n = entries.capacity if bound is None else max(0, min(entries.capacity, bound))
            n = min(n, max(0, int(entries.count[0])))
            if not n or not self._any_reserved(entries.slot[:n].numpy()):
                return
        self.ops.reserved_reads(entries=entries, reserved=self.reserved, ring=self.c.ring, launch_tag=launch_tag,
                                bound=bound, host_reads=self._host())

    def read_past_length(self, position: int, listed: int, slot=None) -> None:
        """Report a forward whose engine reads ``listed`` cells of its read index for ``position`` live
        positions (prefix + new over the batch; ``listed > position``): one ``read_past_length`` row, its
        SLOT ``slot`` (a 1-element tensor, the first extra cell's slot, copied on the device: no host read;
        None: -1). The request is unknown (a length over the whole batch)."""
        c = self.c
        if not c.enabled:
            return
        if listed <= position or position < 0:
            raise ValueError(f"kv-canary: read_past_length expects listed > position >= 0, got listed={listed}, "
                             f"position={position}")
        with c.launcher.side():
            # (filled with scalars, not built from a host list: a pageable host-to-device copy waits for the stream)
            row = torch.full((1, 8), -1, dtype=torch.int64, device=c.device)
            row[0, 0], row[0, 2], row[0, 6], row[0, 7] = c.groups[0].tag("head", "k"), position, listed, READ_PAST
            if slot is not None:
                row[0, 1:2].copy_(slot.reshape(-1)[:1])
            self._push(row, torch.ones(1, dtype=torch.bool, device=c.device))

    def _host(self) -> bool:
        """Whether values may be read on the host: the CPU, outside a recorded step (an adapter's captured step
        replays tensor ops only, ``Canary.use_graphs(host_ops=False)``), where the device path runs instead."""
        return self._cpu and self.c.launcher.host_ops

    def _push(self, rows, flag: torch.Tensor) -> None:
        """Append ``rows[flag]`` to the ring (``ops.torch_ops._push``), reading no value on the host where
        ``_host`` says none may be read."""
        _push(self.c.ring, rows, flag, host_reads=self._host())

    def names_reserved(self, slot) -> bool:
        """CPU: whether the numpy array ``slot`` names a reserved slot (False with the check off)."""
        return self.reserved is not None and self._any_reserved(slot)

    def _any_reserved(self, slot: torch.Tensor) -> bool:
        """CPU: whether any of ``slot`` is reserved (numpy on views: a tensor op costs tens of microseconds here)."""
        mask, s = self._reserved_np, slot
        return bool(mask[s[(s >= 0) & (s < mask.shape[0])]].any())

    # -- TAIL: non-finite KV -------------------------------------------------------------------------
    def after(self) -> None:
        """The first live token (and source) of the forward whose written KV is NaN or Inf, if any."""
        if not self.float_sources:
            return
        launcher = self.c.launcher
        with launcher.side():
            if self._host():  # (the common case in microseconds: every written byte finite)
                live = launcher.inputs.loc[0].numpy()[:int(self._offs_np[launcher.key[0]])]
                if all(_finite_np(src, rows, live) for (_, _, src), rows in zip(self.float_sources, self._rows_np)):
                    return
            if launcher.staged_now:
                # static buffers only (the staged inputs, the plan, the KV): captured once per shape and replayed,
                # with TAIL and the snapshot where TAIL waits for them (eagerly, its some 45 tensor ops cost the
                # host about 1.5 ms per 1B step on the H200)
                if not launcher.extend_tail("nonfinite", self._after_device):
                    launcher.graphs.run(("nonfinite",) + launcher.key, lambda call: call(self._after_device))
                return
            self._after_device()

    def _after_device(self) -> None:
        """The non-finite check's device pass (no host read: capturable), on the current stream."""
        c = self.c
        c.launcher.streams.note("nonfinite_check", reads=("plan", "staged", "kv"), atomic=("ring",))
        x = c.launcher.inputs
        self.ops.nonfinite(out_cache_loc=x.loc[0], write_offsets=c.groups[0].plan.write_offsets,
                           num_requests=c.launcher.key[0], positions=x.positions, input_ids=x.input_ids,
                           writer_ids=x.writer_ids, num_slots=c.pool.num_slots,
                           sources=self._sources, tags=self._tags, index=self._index,
                           ring=c.ring, scratch=self._first, host_reads=self._host())

    # -- poison on free ------------------------------------------------------------------------------
    def poison(self, slots) -> int:
        """Fill ``slots``' KV in every real-KV source of the full group with ``POISON``; reserved slots
        are left alone. Returns how many slots were poisoned (0 when ``poison_on_free`` is off)."""
        c = self.c
        if not self.poison_on or not c.enabled:
            return 0
        slots = slots if isinstance(slots, torch.Tensor) else torch.as_tensor(slots, dtype=torch.int64)
        slots = slots_tensor("poison_slots", "slots", slots, c.pool.num_slots, c.device)
        if self.reserved is not None:
            slots = slots[~self.reserved[slots]]
        else:
            slots = slots[slots != 0]
        if not slots.shape[0]:
            return 0
        c.launcher.join()  # after TAIL's reads of these slots' bytes (the previous step's hash)
        g = c.groups[0]
        for src in (*g.sources["k"], *g.sources["v"]):
            rows, cols = byte_cells(src, slots)
            src.byte_rows()[rows, cols] = _pattern(cols)
        self.poisoned_count += int(slots.shape[0])
        return int(slots.shape[0])

    def is_poisoned(self, slot: int) -> bool:
        """Whether ``slot``'s bytes are the poison pattern in a real-KV source of the full group (reports only)."""
        g = self.c.groups[0]
        for src in (*g.sources["k"], *g.sources["v"]):
            if 0 < slot < src.num_slots:
                rows, cols = byte_cells(src, torch.tensor([slot], device=src.tensor.device))
                if bool((src.byte_rows()[rows, cols] == _pattern(cols)).all()):
                    return True
        return False

    # -- reports -------------------------------------------------------------------------------------
    def attribution(self, row: list[int], step: int, monitor) -> dict:
        """What a report adds to a row of these checks (``Monitor._decode``)."""
        bits = row[7]
        if bits & READ_PAST:
            return {}  # (a length over the whole batch: no request, no writer)
        if bits & READ:
            return monitor._reader(row, step, "full", "k", "head")
        out = {"writer_request": row[5] if row[5] >= 0 else None, "writer_step": step}
        if bits & NONFINITE:
            out["layer"] = row[6]
            out["poisoned"] = self.is_poisoned(row[1])
        return out

    def stats(self) -> dict:
        return {"poisoned_slots": self.poisoned_count}


def _finite_np(src, rows, slot) -> bool:
    """CPU: whether every element of ``slot``'s KV in ``src`` is finite (numpy on ``rows``, its words' view)."""
    slot = slot[(slot >= 1) & (slot < src.num_slots)]
    if not slot.shape[0]:
        return True
    exp = EXPONENT[src.tensor.dtype]
    words = rows[slot // src.page_size, slot % src.page_size]  # [n, words of one token]
    return not bool(((words & exp) == exp).any())


def _pattern(cols: torch.Tensor) -> torch.Tensor:
    """The poison's bytes at byte columns ``cols`` (uint8, their shape)."""
    return torch.where(cols % 2 == 0, POISON[0], POISON[1]).to(torch.uint8)
