"""Violations as users read them: objects, the structured log line, a readable block, JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from kvcanary.format import FailReason, LaunchTag, ViolationField as F, reason_label, to_signed, to_unsigned

WRITE_REASONS = int(FailReason.WRITE_TOKEN | FailReason.WRITE_POSITION)
# the slot checks' reasons (runtime/slots.py): rows with layouts of their own (docs/slots.md)
SLOT_REASONS = int(FailReason.RESERVED_SLOT_READ | FailReason.RESERVED_SLOT_WRITE | FailReason.NONFINITE_KV
                   | FailReason.READ_PAST_LENGTH)
# the write and attention-metadata checks' reasons (runtime/write_check.py, runtime/attention_check.py): rows with
# layouts of their own (docs/write_check.md)
CHECK_REASONS = int(FailReason.WRITE_KV | FailReason.ATTENTION_MASK | FailReason.KEY_LENGTH)
# Expected token of a position the engine's token history does not cover (an adapter sets it when a
# request's history is shorter than its positions): never equal to a stored token, so it is reported.
MISSING_TOKEN = -2


@dataclass(frozen=True)
class Violation:
    """One violation row, decoded, plus attribution the runtime could add.

    ``expected_aux`` is the expected prev_hash for verify rows and the expected position
    for write-time rows; hashes are unsigned 64-bit ints. Steps count forwards from 1: ``step``
    is the forward whose check found the violation, ``writer_step`` the forward that last wrote
    the slot's record. ``writer_token`` / ``writer_position`` are set when that record was
    rewritten after the check read it (a TAIL check before the same step's TAIL write): the
    writer then put that token and position there. ``slot_position`` (write-time rows) is the
    position whose slot the writing request's table says the written slot is. ``layer`` (a
    ``nonfinite_kv`` row) is the index of the real-KV source whose bytes were not finite, in
    ``PoolSpec`` order; a ``write_kv`` row: the engine's layer number where the adapter names it);
    ``poisoned``: the slot's KV is the poison pattern of a freed slot; ``source`` (a ``write_kv`` row): which
    cache of which layer holds bytes other than the layer computed, in words ("V of layer 1 (full group)");
    ``written_wrong`` (a ``verify_real_kv_hash`` row): the read slot's record is the one the write check marked
    when it found that write wrong (a ``write_kv`` row at ``writer_step``): this request reads what that write
    left.

    ``reader_request`` / ``reader_position`` name the request whose verify entry wrote this row (each failing
    entry writes one). ``readers`` / ``reader_positions``: every request of the same forward whose read of the
    slot failed exactly as this row's (rows identical in every field: a shared prefix block, a parent and its
    forks), this row's own reader included, in ring order (``runtime/readers.py``); empty where no reader
    was named (write-time, sweep and unattributed rows).
    """

    step: int
    launch_tag: str
    fail_reason: int
    reasons: tuple[str, ...]
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    reader_request: int | None = None
    reader_position: int | None = None
    writer_request: int | None = None
    writer_step: int | None = None
    writer_token: int | None = None
    writer_position: int | None = None
    slot_position: int | None = None
    layer: int | None = None
    poisoned: bool = False
    written_wrong: bool = False
    readers: tuple[int, ...] = ()
    reader_positions: tuple[int, ...] = ()
    source: str | None = None

    @classmethod
    def from_row(cls, row: list[int], step: int, **attribution) -> Violation:
        bits = int(row[F.FAIL_REASON])
        return cls(
            step=step,
            launch_tag=_tag_name(int(row[F.KIND])),
            fail_reason=bits,
            reasons=tuple(reason_label(bits).split("+")),
            slot=int(row[F.SLOT]),
            position=int(row[F.POSITION]),
            stored_token=int(row[F.STORED_TOKEN]),
            expected_token=int(row[F.EXPECTED_TOKEN]),
            stored_chain_hash=to_unsigned(int(row[F.STORED_CHAIN_HASH])),
            expected_aux=to_unsigned(int(row[F.EXPECTED_AUX])),
            **attribution,
        )

    @property
    def is_write_check(self) -> bool:
        return bool(self.fail_reason & WRITE_REASONS)

    @property
    def reason_label(self) -> str:
        return "+".join(self.reasons)

    def log_line(self) -> str:
        """The structured line of SPEC 5, one per violation."""
        return (f"kv_canary violation: launch_tag={self.launch_tag} fail_reason={self.reason_label} "
                f"slot_idx={self.slot} position={self.position} stored_token={self.stored_token} "
                f"expected_token={self.expected_token} stored_chain_hash=0x{self.stored_chain_hash:016x} "
                f"expected_aux=0x{self.expected_aux:016x}")

    @property
    def never_written(self) -> bool:
        """A verify row whose record is empty: no write reached the slot (a written record's
        prev hash is a hash output, never 0 in practice)."""
        return (not self.is_write_check and not self.fail_reason & (SLOT_REASONS | CHECK_REASONS)
                and self.stored_chain_hash == 0
                and self.stored_token == 0 and self.position == 0)

    def block(self, name_of=None) -> str:
        """A readable multi-line explanation. ``name_of(request_id)``: the engine's own id of a request (or
        None), printed next to the canary's int where the block names a reader or writer."""
        text = self._block()
        if name_of is None:
            return text
        named = {rid: name_of(rid) for rid in {self.reader_request, self.writer_request, *self.readers}
                 if rid is not None}
        for rid, name in named.items():
            if name is not None:
                for label in ("read by request", "last written by request", "    request"):
                    text = text.replace(f"{label} {rid} ", f"{label} {rid} ({name!r}) ")
        return text

    def _block(self) -> str:
        lines = [f"KV canary violation at step {self.step} ({self.launch_tag}): {self.reason_label}"]
        if self.fail_reason & CHECK_REASONS:
            return "\n".join(lines + self._check_lines())
        if self.fail_reason & SLOT_REASONS:
            return "\n".join(lines + self._slot_lines())
        if self.is_write_check:
            lines += self._write_lines()
        elif self.never_written:
            lines.append(f"  slot {self.slot} was never written: its record is empty (no KV write reached it since "
                         "the pool was created)")
            if self.expected_token not in (-1, 0):
                lines.append(f"  expected token: {self.expected_token}")
        else:
            lines.append(f"  slot {self.slot} holds token {self.stored_token} of position {self.position}")
            if self.expected_token == MISSING_TOKEN:
                lines.append("  expected token: none: the engine's token history of the reader is shorter than its "
                             "positions")
            elif self.expected_token != -1:
                lines.append(f"  expected token: {self.expected_token}")
            if self.fail_reason & FailReason.VERIFY_CHAIN_HASH:
                lines.append(f"  chain: stored prev hash 0x{self.stored_chain_hash:016x} != expected "
                             f"0x{self.expected_aux:016x} (the slot's predecessor in the reader's table "
                             "is not the one it was written after)")
            if self.fail_reason & FailReason.VERIFY_REAL_KV_HASH:
                if self.written_wrong:
                    lines.append("  real KV: the slot holds other bytes than its layer computed (the write check "
                                 "reported that write: a write_kv row)")
                else:
                    lines.append("  real KV: the slot's KV bytes changed since they were written" + (
                        ": they are the poison pattern of a freed slot (poison_on_free)" if self.poisoned else ""))
        lines += self._reader_lines()
        if self.writer_request is not None:
            if self.writer_position is not None:
                lines.append(f"  last written by request {self.writer_request} at step {self.writer_step}, with "
                             f"token {self.writer_token} of position {self.writer_position} (after this check)")
            else:
                lines.append(f"  last written by request {self.writer_request} at step {self.writer_step}")
        lines += self._verdict()
        return "\n".join(lines)

    def _reader_lines(self) -> list[str]:
        if len(self.readers) > 1:  # (several requests read the slot alike: one row each, one block for all)
            return [f"  read by {len(self.readers)} requests in this forward, each failing this check:"] + [
                f"    request {r} at position {p}" for r, p in zip(self.readers, self.reader_positions)]
        if self.reader_request is not None:
            return [f"  read by request {self.reader_request} at position {self.reader_position}"]
        return []

    def _write_lines(self) -> list[str]:
        expected_pos = to_signed(self.expected_aux)
        lines = [f"  the engine wrote token {self.stored_token} of position {self.position} into slot {self.slot}"]
        if self.slot_position is not None and self.slot_position != self.position:
            lines.append(f"  slot {self.slot} is position {self.slot_position}'s slot in the writer's table: position "
                         f"{self.position} went into position {self.slot_position}'s slot")
        if self.fail_reason & FailReason.WRITE_TOKEN:
            lines.append(f"  expected token {self.expected_token} at position {self.position}")
        # A misplaced slot explains a position failure better than the chain's expectation does.
        if self.fail_reason & FailReason.WRITE_POSITION and self.slot_position in (None, self.position):
            held = "an empty record (never written)" if expected_pos == 1 else f"position {expected_pos - 1}"
            lines.append(f"  expected position {expected_pos}: the request's previous record (the slot its table "
                         f"gives position {self.position - 1}) holds {held}, not position {self.position - 1}")
        return lines

    def _check_lines(self) -> list[str]:
        """The readable lines of a write-check or attention-metadata row (docs/write_check.md has the layouts)."""
        who = "" if self.reader_request is None else f" of request {self.reader_request}"
        if self.fail_reason & FailReason.WRITE_KV:
            what = self.source or f"real-KV source {self.expected_token}"
            return [f"  slot {self.slot} holds other bytes in the {what} than the layer computed for token "
                    f"{self.stored_token} at position {self.position}{who} (the KV handed to the cache update) at "
                    f"step {self.step}",
                    "  -> the cache write stored something else: a write that skipped this cache (K without V), wrote "
                    "the other cache (V into K), landed short or in another slot; every later read of the slot reads "
                    "the wrong KV"]
        if self.fail_reason & FailReason.KEY_LENGTH:
            return [f"  request{who or ' ?'}'s key length handed to attention is {self.stored_token}, its read index "
                    f"holds {self.expected_token} keys (first query position {self.position})",
                    "  -> attention reads other keys than the ones verified: another request's, or fewer than its own"]
        col = to_signed(self.expected_aux)
        seen = "may attend" if self.stored_token else "may not attend"
        should = "a key of its own" if self.expected_token else "a key its read index does not give it"
        slot = f" (slot {self.slot})" if self.slot >= 0 else ""
        return [f"  the attention mask says the query at position {self.position}{who} {seen} key column {col}"
                f"{slot}: {should}",
                "  -> " + ("attention reads another request's keys (or keys past the request's length): a mask not "
                           "reset or built over the wrong lengths" if self.stored_token else
                           "attention hides keys the request must read: a mask built over the wrong lengths")]

    def _slot_lines(self) -> list[str]:
        """The readable lines of a slot-check row (runtime/slots.py; row layouts in docs/slots.md)."""
        if self.fail_reason & FailReason.READ_PAST_LENGTH:
            listed = to_signed(self.expected_aux)
            first = "" if self.slot < 0 else f" (the first extra one: slot {self.slot})"
            return [f"  the engine's read index lists {listed} slots for the batch's {self.position} live positions "
                    f"(prefix + new tokens over its requests): {listed - self.position} past the lengths{first}",
                    "  -> attention reads cells past a request's length (a partial block's unused tail, a key length "
                    "taken from allocated blocks): KV no write of the request made"]
        if self.fail_reason & FailReason.RESERVED_SLOT_READ:
            who = "" if self.reader_request is None else f" of request {self.reader_request}"
            return [f"  position {self.position}{who} is read from slot {self.slot}, a reserved slot (slot 0 or an "
                    "engine trash/padding slot) that holds no live token's KV",
                    "  -> a live token mapped to the padding/trash slot: a cleared or never-filled table cell, or a "
                    "read index padded into the live range"]
        who = "" if self.writer_request is None else f" of request {self.writer_request}"
        if self.fail_reason & FailReason.RESERVED_SLOT_WRITE:
            return [f"  the engine wrote token {self.stored_token} of position {self.position}{who} into slot "
                    f"{self.slot}, a reserved slot (slot 0 or an engine trash/padding slot)",
                    "  -> a live token's KV went where padding goes: its own slot is never written"]
        kv = "V" if self.launch_tag.startswith("TAIL_V") else "K"
        lines = [f"  the KV written for token {self.stored_token} at position {self.position}{who} into slot "
                 f"{self.slot} at step {self.step} is not finite (NaN/Inf) in {kv} real-KV source {self.layer}"]
        if self.poisoned:
            return lines + ["  -> the slot still holds the poison of its free (poison_on_free): this forward's write "
                            "missed that source (a partial write, a layer left out)"]
        return lines + ["  -> the model produced NaN/Inf here (an overflow, uninitialised or poisoned input KV); "
                        "every later token that reads it inherits it"]

    def _verdict(self) -> list[str]:
        if self.is_write_check:
            return []
        if self.poisoned:
            return ["  -> a read of a freed slot: the engine freed it while this request still maps it (a use after "
                    "free)"]
        if self.never_written:
            return ["  -> the reader's table maps a slot no forward wrote: a missing KV write, or a wrong table or "
                    "read-index entry"]
        if self.expected_token == MISSING_TOKEN:
            return ["  -> the engine fed a token its request history does not hold: a dropped or late history update"]
        if self.fail_reason == FailReason.VERIFY_REAL_KV_HASH:
            if self.written_wrong:
                return ["  -> this request reads KV that a wrong cache write left (a write that skipped a cache, wrote "
                        "the other one or landed short): a victim of that write"]
            if self.writer_position is not None:
                return [f"  -> a write of position {self.writer_position} landed in a slot still read as position "
                        f"{self.position}: a write index or table entry pointing at a live slot"]
            return ["  -> the KV bytes changed under an intact record: a skipped or partial copy (some layers, K "
                    "without V), a stray write, or a transfer into the wrong place"]
        if self.reader_request is None or self.writer_request is None:
            return []
        if self.reader_request != self.writer_request:
            return ["  -> two requests own this slot: double allocation, early free or a stale table entry"]
        if self.fail_reason & FailReason.VERIFY_POSITION and self.reader_position != self.position:
            return [f"  -> the request reads its own position {self.position}'s slot as position "
                    f"{self.reader_position}: a wrong table or read-index entry, or a misplaced write"]
        return []

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reasons"] = list(self.reasons)
        d["readers"], d["reader_positions"] = list(self.readers), list(self.reader_positions)
        return d


def _tag_name(kind: int) -> str:
    try:
        return LaunchTag(kind).name
    except ValueError:
        return f"UNKNOWN_{kind}"


class KvCanaryViolationError(RuntimeError):
    """Raised in mode "raise" after a drain that found violations."""

    def __init__(self, violations: list[Violation], total: int):
        self.violations = violations
        self.total = total
        head = "\n".join(v.log_line() for v in violations[:5])
        more = f"\n... and {total - min(total, 5)} more" if total > 5 else ""
        super().__init__(f"kv-canary: {total} violation(s)\n{head}{more}")


class KvCanaryHealthError(RuntimeError):
    """Raised by the health check in mode "raise" when an expected launch stopped running."""


def violations_to_json(violations: list[Violation], total: int | None = None, indent: int | None = 2) -> str:
    """All violations as JSON: {"total": N, "stored": n, "violations": [...]}."""
    total = len(violations) if total is None else total
    return json.dumps({"total": total, "stored": len(violations),
                       "violations": [v.to_dict() for v in violations]}, indent=indent)


def memory_bytes(canary) -> dict:
    """``Canary.memory``: bytes the canary holds on its device, by part."""
    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts)

    groups = canary.groups
    out = {"record_bytes_per_slot": {g.name: sum(b.shape[1] for b in g.bufs.values()) for g in groups},
           "canary_buffers": sum(nbytes(*g.bufs.values()) for g in groups),
           "plans": sum(nbytes(g.plan.entries.slot, g.plan.entries.position, g.plan.entries.prev,
                               g.plan.entries.expected_token, g.plan.write_offsets, g.plan.seed_slot)
                        for g in groups),
           "sweep_entries": sum(nbytes(g.sweep_entries.slot, g.sweep_entries.position, g.sweep_entries.prev,
                                       g.sweep_entries.expected_token) for g in groups),
           "token_table": nbytes(canary.token_table),
           "ring": nbytes(canary.ring.rows) * (1 + len(canary.monitor.observer.slots))}
    out["total"] = sum(n for k, n in out.items() if k != "record_bytes_per_slot")
    return out
