"""Shared harness of the op tests: poisoned state, one op sequence run on two backends, exact comparison.

A case builds a state dict (canary buffers, plan, ring, counters, tables, KV sources) and an
``ops(state, backend)`` function. ``check`` runs the ops on two identical copies, once with the
scalar reference and once with a fast backend, then compares every tensor byte for byte (the
ring as a sorted set for Triton, whose launches push in a different order).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
from unittest import mock

import pytest
import torch

from kvcanary.format import CHAIN_HEAD, link, to_signed
from kvcanary.ops import Plan, RealKvSource, ViolationRing, torch_ops

# Poison of fresh outputs: an op that leaves a cell unwritten keeps it, the reference does not.
SENTINEL = 0x5A5A5A5A5A5A5A5A
SENTINEL32 = 0x5A5A5A5A


def use_backend(backend: str) -> str:
    """The backend name, or a skip when its module does not import (Triton is written separately).

    ``torch-static`` is the torch backend forced onto its accelerator path (static shapes, no host
    reads of device counts), so CPU runs cover the code CUDA graphs capture.
    """
    if backend == "torch-static":
        return "torch"
    if backend == "numba":
        from kvcanary.ops import api

        if not api.numba_available():
            pytest.skip("numba is not installed (pip install 'kv-canary[cpu]')")
    if backend == "triton":
        try:
            importlib.import_module("kvcanary.ops.triton_ops")
        except Exception as exc:  # noqa: BLE001 - any import failure of that module is theirs
            pytest.skip(f"kvcanary.ops.triton_ops unavailable: {exc!r}")
    return backend


@contextlib.contextmanager
def static_shapes(on: bool):
    if not on:
        yield
        return
    with mock.patch.object(torch_ops, "_host_reads", lambda device: False):
        yield


def poisoned_plan(capacity: int, max_batch: int, device) -> Plan:
    p = Plan.allocate(capacity, max_batch, device)
    for t in (p.entries.slot, p.entries.position, p.entries.prev, p.entries.expected_token, p.entries.count,
              p.entries.requested, p.write_offsets, p.seed_slot):
        t.fill_(SENTINEL)
    p.entries.enable.fill_(SENTINEL32)
    return p


def poisoned_ring(capacity: int, device) -> ViolationRing:
    ring = ViolationRing.allocate(capacity, device)
    ring.rows.fill_(SENTINEL)
    return ring


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """name -> tensor (or ViolationRing, compared specially) for everything reachable in a state."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, ViolationRing):
        return {prefix: obj}
    if dataclasses.is_dataclass(obj):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        obj = dict(enumerate(obj))
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def ring_rows(ring: ViolationRing) -> list[tuple[int, ...]]:
    n = min(int(ring.write_index[0]), ring.capacity)
    return [tuple(r) for r in ring.rows[:n].tolist()]


def assert_same(ref: dict, fast: dict, exact_ring: bool, full_rows=None) -> None:
    fr, ff = flatten(ref), flatten(fast)
    assert fr.keys() == ff.keys()
    for name, a in fr.items():
        b = ff[name]
        if isinstance(a, ViolationRing):
            assert torch.equal(a.write_index, b.write_index), f"{name}.write_index {a.write_index} != {b.write_index}"
            if exact_ring:
                assert torch.equal(a.rows, b.rows), f"{name}.rows differ:\n{a.rows}\n{b.rows}"
                continue
            n = min(int(a.write_index[0]), a.capacity)
            assert torch.equal(a.rows[n:], b.rows[n:]), f"{name}: rows past the write index were touched"
            if int(a.write_index[0]) <= a.capacity:
                assert sorted(ring_rows(a)) == sorted(ring_rows(b)), f"{name} row sets differ"
            elif full_rows is not None:
                extra = set(ring_rows(b)) - set(full_rows(name))
                assert not extra, f"{name}: rows the reference never pushes: {extra}"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # Compare bytes: float KV may hold NaN patterns, and equality must be bit for bit anyway.
        ab, bb = as_bytes(a), as_bytes(b)
        if not torch.equal(ab, bb):
            where = (ab != bb).nonzero()[:8].tolist()
            raise AssertionError(f"{name} differs at byte index {where}:\nreference {a}\nfast      {b}")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def check(build, run, backend: str) -> dict:
    """Run ``run(state, backend)`` on the reference and on ``backend`` from one built state; compare all.

    ``build()`` returns a fresh state dict whose violation rings are top-level entries.
    """
    name = use_backend(backend)
    ref = build()
    fast = copy.deepcopy(ref)
    run(ref, "reference")
    with static_shapes(backend == "torch-static"):
        run(fast, name)

    def full_rows(name):
        # Under ring overflow a parallel backend keeps some capacity-sized subset of all rows.
        big = build()
        start = big[name]
        if int(start.write_index[0]) >= start.capacity:
            return ring_rows(start)  # the count starts past capacity: no push of this run can land
        big[name] = poisoned_ring(max(start.capacity, int(ref[name].write_index[0])), start.rows.device)
        big[name].rows[:start.capacity] = start.rows
        big[name].write_index.copy_(start.write_index)
        run(big, "reference")
        return ring_rows(big[name])

    # The serial backends push rows in the reference's order; only Triton's launches may reorder them.
    assert_same(ref, fast, exact_ring=name in ("torch", "numba"), full_rows=full_rows)
    return ref


def reasons(ring: ViolationRing) -> set[tuple[int, int]]:
    """{(launch tag, fail reason)} of the stored rows."""
    return {(r[0], r[7]) for r in ring_rows(ring)}


# Building blocks of engine states.

def kv_source(num_slots: int, dtype=torch.float16, page_size: int = 1, nbpt: int = 32, read_bytes: int | None = None,
              pad_bytes: int = 0, device="cpu", seed: int = 0, three_d: bool = False) -> RealKvSource:
    """Random KV pages of ``dtype``; ``pad_bytes`` > 0 widens each row (a non-contiguous row stride)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows = -(-num_slots // page_size)
    width = page_size * nbpt + pad_bytes
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=g)
    t = raw.view(dtype).to(device)[:, :page_size * nbpt // itemsize]
    if three_d:
        t = t.unflatten(1, (page_size, nbpt // itemsize))
    return RealKvSource(t, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=read_bytes or nbpt)


def flip_kv_byte(src: RealKvSource, slot: int, byte: int = 0) -> None:
    """XOR one byte of a slot's KV (in place, through the byte view of its pages)."""
    row, col = divmod(slot, src.page_size)
    src.byte_rows()[row, col * src.num_bytes_per_token + byte] ^= 0xFF


def put_record(buf: torch.Tensor, slot: int, token: int, position: int, prev_hash: int, real: int = 0) -> None:
    buf.view(torch.int64)[slot, :4] = torch.tensor([to_signed(token), to_signed(position), to_signed(prev_hash),
                                                    to_signed(real)])


def clean_chain(buf: torch.Tensor, slots: list[int], tokens: list[int], start_pos: int = 0,
                head: int = CHAIN_HEAD) -> int:
    """Write a clean chain of records; returns link of the last record (the next prev_hash)."""
    running = head
    for k, (s, t) in enumerate(zip(slots, tokens)):
        put_record(buf, s, t, start_pos + k, running)
        running = link(running, t, start_pos + k)
    return running
