"""Prefill/decode disaggregation: canary records travel with a request's KV and are checked on arrival.

A prefill instance computes a request's KV; a transfer layer moves it into a decode
instance's pool under new slot numbers. The records of the moved slots travel with
it, byte for byte (SPEC 3.2: token, position, prev_hash, real-KV hash, writer fields),
in every canary buffer of the group. Nothing in a record names its slot, and the chain
hashes depend only on tokens and positions, so a record is valid under any slot
number: the decode side lands it at the new slots (``land_records``) and the chain,
positions, tokens and real-KV hashes must continue exactly there.

``ArrivalCheck`` verifies an arrived request before its first decode forward through
the decode side's own table: the slots the table maps must hold the records that
arrived (chain, positions, the tokens the prefill side sent) and KV bytes whose
fingerprint equals the real-KV hash computed on the prefill side. The decode canary's
first forward then verifies the same prefix again (HEAD, TAIL with real KV).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvcanary import ops
from kvcanary.format import RealKvMode, launch_tag
from kvcanary.runtime.report import Violation

_MAGIC = 0x4B56434E  # "KVCN": the header of a canary transfer
_HEADER = 8
_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64)
_MAX_DIMS = 4


@dataclass
class RecordPacket:
    """The canary side of one request's transfer.

    Attributes:
        request_id: the engine's request id (attribution only).
        start: first position transferred (0 unless the decode side already held a prefix).
        tokens: int64 [n] token of each transferred position (the prefill side's history).
        records: uint8 [num_buffers, n, stride] the records of the transferred slots, one plane per
            canary buffer of the group in ``buffer_keys`` order.
    """

    request_id: int
    start: int
    tokens: torch.Tensor
    records: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def buffer_keys(canary, group: str = "full") -> list[tuple[str, str]]:
    """The order in which a group's buffers travel: (phase, kv) sorted, e.g. head/k, tail/k."""
    return sorted(canary._group(group).bufs)


def pack_records(canary, slots: torch.Tensor, tokens: torch.Tensor, request_id: int, start: int = 0,
                 group: str = "full") -> RecordPacket:
    """Copy the records of ``slots`` (positions start .. start + n - 1 of the request) for sending.

    Args:
        canary: the prefill instance's ``Canary``.
        slots: int64 [n] the request's slots on the prefill side, in position order.
        tokens: int32/int64 [n] the tokens at those positions.
        request_id: the request's id.
        start: position of ``slots[0]``.
    """
    if slots.dim() != 1 or tokens.dim() != 1 or slots.shape != tokens.shape:
        raise ValueError(f"kv-canary: pack_records slots and tokens must be 1-D of one length, got "
                         f"{tuple(slots.shape)} and {tuple(tokens.shape)}")
    if start < 0:
        raise ValueError(f"kv-canary: pack_records start must be >= 0, got {start}")
    saved = canary.save_records(slots, group)
    planes = torch.stack([saved[k] for k in buffer_keys(canary, group)])
    return RecordPacket(int(request_id), int(start), tokens.to(torch.int64).cpu(), planes)


def land_records(canary, packet: RecordPacket, slots: torch.Tensor, group: str = "full") -> None:
    """Write an arrived packet's records into the decode canary's buffers at ``slots`` (byte for byte).

    Args: slots: int64 [n] the decode-side slots that received positions start .. start + n - 1.
    """
    keys = buffer_keys(canary, group)
    g = canary._group(group)
    if slots.dim() != 1 or slots.shape[0] != packet.num_tokens:
        raise ValueError(f"kv-canary: land_records slots must be 1-D of the packet's length ({packet.num_tokens}), "
                         f"got shape {tuple(slots.shape)}")
    expected = (len(keys), packet.num_tokens, g.bufs[keys[0]].shape[1])
    if tuple(packet.records.shape) != expected:
        raise ValueError(f"kv-canary: land_records packet records must be [buffers, n, stride] = {expected} (the "
                         f"same canary configuration on both sides), got {tuple(packet.records.shape)}")
    canary.restore_records({k: packet.records[i].to(canary.device) for i, k in enumerate(keys)}, slots, group)


# -- sending over torch.distributed -----------------------------------------------------------------
def wire_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view of the same storage.

    KV travels as bytes because NCCL has no 16-bit integer type (int16 pages would be refused) and
    bytes are what the real-KV hash covers anyway; a receive into the view fills the typed tensor.
    """
    return t.reshape(-1).view(torch.uint8)


def send_transfer(packet: RecordPacket, kv: Sequence[torch.Tensor], dst: int, device: torch.device | str = "cpu",
                  group=None) -> None:
    """Send a packet and the request's KV tensors to rank ``dst`` (blocking point-to-point sends).

    ``kv``: the KV pages in the engine's own layout (any shapes, up to 4 dims, common dtypes).
    ``device``: where tensors must be to travel (cpu for gloo, the rank's GPU for NCCL).
    """
    for t in kv:
        if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
            raise ValueError(f"kv-canary: send_transfer kv tensors must have <= {_MAX_DIMS} dims and a dtype of "
                             f"{_DTYPES}, got {t.dtype} with {t.dim()} dims")
    n, planes = packet.num_tokens, packet.records
    header = [_MAGIC, packet.request_id, packet.start, n, planes.shape[0], planes.shape[2] if n else 0, len(kv), 0]
    desc = [[_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (_MAX_DIMS - t.dim())] for t in kv]
    dev = torch.device(device)
    dist.send(torch.tensor(header, dtype=torch.int64, device=dev), dst, group=group)
    if kv:
        dist.send(torch.tensor(desc, dtype=torch.int64, device=dev), dst, group=group)
    dist.send(packet.tokens.to(dev), dst, group=group)
    dist.send(planes.contiguous().to(dev), dst, group=group)
    for t in kv:
        dist.send(wire_bytes(t.contiguous().to(dev)), dst, group=group)


def recv_transfer(src: int, device: torch.device | str = "cpu", group=None) -> tuple[RecordPacket, list[torch.Tensor]]:
    """Receive what ``send_transfer`` sent from rank ``src``: the packet and the KV tensors (on ``device``)."""
    dev = torch.device(device)
    header = torch.empty(_HEADER, dtype=torch.int64, device=dev)
    dist.recv(header, src, group=group)
    magic, rid, start, n, nbuf, stride, nkv, _ = header.tolist()
    if magic != _MAGIC:
        raise ValueError(f"kv-canary: recv_transfer header must start with 0x{_MAGIC:x}, got 0x{magic:x} "
                         "(sends and receives out of step)")
    desc = []
    if nkv:
        d = torch.empty(nkv, 2 + _MAX_DIMS, dtype=torch.int64, device=dev)
        dist.recv(d, src, group=group)
        desc = d.tolist()
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    dist.recv(tokens, src, group=group)
    planes = torch.empty(nbuf, n, stride, dtype=torch.uint8, device=dev)
    dist.recv(planes, src, group=group)
    kv = []
    for code, ndim, *dims in desc:
        t = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=dev)
        dist.recv(wire_bytes(t), src, group=group)
        kv.append(t)
    return RecordPacket(rid, start, tokens, planes), kv


# -- checking an arrival -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TransferViolation:
    """A violation found by ``ArrivalCheck``: where it was found and which transfer brought the slot."""

    instance: str
    rank: int
    src_rank: int | None
    request_id: int
    violation: Violation

    def log_line(self) -> str:
        rest = self.violation.log_line().removeprefix("kv_canary violation: ")
        return (f"kv_canary transfer violation: instance={self.instance} rank={self.rank} src_rank={self.src_rank} "
                f"request={self.request_id} {rest}")

    def to_dict(self) -> dict:
        return {"instance": self.instance, "rank": self.rank, "src_rank": self.src_rank,
                "request_id": self.request_id, **self.violation.to_dict()}


class ArrivalCheck:
    """Verify arrived requests through the decode side's table before their first decode forward.

    Args:
        canary: the decode instance's ``Canary`` (records already landed with ``land_records``).
        instance: name of the instance in reports (e.g. "decode").
        rank: this process's rank (reports; default: the default group's rank, or 0 without one).
        capacity: most positions one check covers (default the canary's ``max_context``).
        ring_capacity: violation rows kept per check.
        group: canary group ("full").
    """

    def __init__(self, canary, *, instance: str = "decode", rank: int | None = None, capacity: int | None = None,
                 ring_capacity: int = 64, group: str = "full"):
        self.canary, self.instance, self.group = canary, instance, group
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        dev = canary.device
        self.entries = ops.Entries.allocate(capacity or canary.max_context, dev)
        self.ring = ops.ViolationRing.allocate(ring_capacity, dev)
        self.counters = ops.allocate_counters(dev)
        self.seconds: list[float] = []  # wall time of each check (it ends with one host read of the ring)
        self.violations: list[TransferViolation] = []
        self.total = 0

    def check(self, packet: RecordPacket, table_slots: torch.Tensor, src_rank: int | None = None
              ) -> list[TransferViolation]:
        """Verify positions start .. start + n - 1 of an arrived request; returns what failed.

        Args:
            packet: the arrived ``RecordPacket`` (its tokens are the expected tokens).
            table_slots: int32/int64 [>= start + n] the decode table's row for the request: the slot
                of each position (position start - 1 gives the chain's predecessor).
            src_rank: the sending rank (reports).
        """
        t0 = time.perf_counter()
        n, start = packet.num_tokens, packet.start
        if table_slots.dim() != 1 or table_slots.shape[0] < start + n:
            raise ValueError(f"kv-canary: ArrivalCheck table_slots must be 1-D with >= {start + n} entries, got "
                             f"shape {tuple(table_slots.shape)}")
        if n > self.entries.capacity:
            raise ValueError(f"kv-canary: ArrivalCheck packet must hold <= capacity ({self.entries.capacity}) "
                             f"positions, got {n}; raise ArrivalCheck(capacity=...)")
        dev = self.canary.device
        row = table_slots[:start + n].to(dev, torch.int64)
        slots = row[start:]
        prevs = torch.cat([row[start - 1:start] if start else torch.full((1,), -1, dtype=torch.int64, device=dev),
                           row[start:start + n - 1]])[:n]
        positions = torch.arange(start, start + n, dtype=torch.int64, device=dev)
        ops.fill_entries(self.entries, slots, positions, prevs, packet.tokens.to(dev))
        g = self.canary._group(self.group)
        for kv in g.kvs:
            mode = int(self.canary.real_kv_mode) if g.sources[kv] else int(RealKvMode.NONE)
            ops.verify(buf=g.bufs["tail", kv], entries=self.entries, ring=self.ring, counters=self.counters,
                       launch_tag=int(launch_tag("tail", kv, self.group)), sources=g.sources[kv], real_kv_mode=mode,
                       backend=self.canary.config.backend)
        count = int(self.ring.write_index.item())
        found = []
        if count:
            rows = self.ring.rows[:min(count, self.ring.capacity)].tolist()
            self.ring.reset()
            for r in rows:
                # Step of the forward the check precedes (the first that reads the arrival).
                v = Violation.from_row(r, self.canary.step + 1, reader_request=packet.request_id,
                                       reader_position=r[2])
                found.append(TransferViolation(self.instance, self.rank, src_rank, packet.request_id, v))
        self.total += count
        self.violations.extend(found)
        self.seconds.append(time.perf_counter() - t0)
        return found

    def cost(self) -> dict:
        """Checks run and mean seconds per check (one check per arrived request)."""
        return {"checks": len(self.seconds),
                "mean_check_s": sum(self.seconds) / len(self.seconds) if self.seconds else 0.0}
