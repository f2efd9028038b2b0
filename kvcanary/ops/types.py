"""Static buffers the ops read and write: plain dataclasses of preallocated tensors.

Every count lives on the device (no host sync to learn how much work there is),
so a plan, a ring or a counter table can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary.format import NUM_LAUNCH_TAGS, VIOLATION_COUNT_LIMIT, VIOLATION_WIDTH

# ``limit`` of ``read_table`` for a read index that lists every slot the batch reads: above any cell's index
# (an int64 the Triton kernel takes unspecialised), so no cell gets the fill
NO_LIMIT = 2**62


@dataclass(frozen=True)
class RealKvSource:
    """Where a slot's KV bytes live: row ``slot // page_size`` of ``tensor``,
    bytes ``[(slot % page_size) * num_bytes_per_token, ... + num_bytes_per_token)``.

    Args:
        tensor: any dtype, ndim >= 2; dim 0 indexes pages, the rest is one page
            (rows step by ``tensor.stride(0)`` elements; trailing bytes ignored).
        page_size: tokens per row (>= 1).
        num_bytes_per_token: bytes of one token's KV in a row (multiple of 16).
        read_bytes: bytes hashed in mode ALL (multiple of 16, <= num_bytes_per_token).
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    def __post_init__(self) -> None:
        from kvcanary.ops.validate import check_real_kv_source

        check_real_kv_source(self)

    @property
    def row_stride_bytes(self) -> int:
        return self.tensor.stride(0) * self.tensor.element_size()

    @property
    def num_slots(self) -> int:
        """Slots this source can address (rows * page_size)."""
        return self.tensor.shape[0] * self.page_size

    def byte_rows(self) -> torch.Tensor:
        """uint8 [rows, page_size * num_bytes_per_token] view of the pages (no copy)."""
        t = self.tensor
        itemsize = t.element_size()
        size, stride = (t.shape[0], self.page_size * self.num_bytes_per_token), (self.row_stride_bytes, 1)
        if t.stride(-1) == 1:
            # view ops only: a recorded step (a CUDA graph, or the CPU stand-in replaying each op into the tensor
            # it returned at capture) sees the same view, where a fresh tensor re-pointed by ``set_`` is not one
            return torch.as_strided(t.view(torch.uint8), size, stride, t.storage_offset() * itemsize)
        flat = torch.empty(0, dtype=torch.uint8, device=t.device)
        flat.set_(t.untyped_storage(), t.storage_offset() * itemsize, size, stride)
        return flat


@dataclass
class Entries:
    """Verify entries: one per (slot a forward reads).

    slot, position, prev, expected_token: int64 [capacity];
    count: int64 [1] entries to verify, at most capacity (SGLang's ``verify_num_valid``);
    enable: int32 [1], 0 when the entries did not fit (the verify is skipped);
    requested: int64 [1] entries asked for, may exceed capacity (tells how much capacity an
        overflowing step needed; not part of SGLang's plan).
    """

    slot: torch.Tensor
    position: torch.Tensor
    prev: torch.Tensor
    expected_token: torch.Tensor
    count: torch.Tensor
    enable: torch.Tensor
    requested: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.slot.shape[0]

    @classmethod
    def allocate(cls, capacity: int, device: torch.device | str = "cpu") -> Entries:
        z = lambda: torch.zeros(capacity, dtype=torch.int64, device=device)  # noqa: E731
        return cls(
            slot=z(),
            position=z(),
            prev=z(),
            expected_token=z(),
            count=torch.zeros(1, dtype=torch.int64, device=device),
            enable=torch.zeros(1, dtype=torch.int32, device=device),
            requested=torch.zeros(1, dtype=torch.int64, device=device),
        )


@dataclass
class Plan:
    """Output of ``plan``: verify entries plus write metadata for up to max_batch requests.

    write_offsets: int64 [max_batch + 1], exclusive cumsum of write lengths, 0 past the batch;
    seed_slot: int64 [max_batch], slot of position prefix_len-1 (translated), or -1 for a request
        without a cached prefix or without tokens to write.
    """

    entries: Entries
    write_offsets: torch.Tensor
    seed_slot: torch.Tensor

    @property
    def max_batch(self) -> int:
        return self.seed_slot.shape[0]

    @classmethod
    def allocate(cls, capacity: int, max_batch: int, device: torch.device | str = "cpu") -> Plan:
        return cls(
            entries=Entries.allocate(capacity, device),
            write_offsets=torch.zeros(max_batch + 1, dtype=torch.int64, device=device),
            seed_slot=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
        )


@dataclass
class ViolationRing:
    """rows: int64 [capacity, 8]; write_index: int32 [1], monotonic (keeps counting past capacity,
    saturating at ``VIOLATION_COUNT_LIMIT`` = 2**30 rather than wrapping)."""

    rows: torch.Tensor
    write_index: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    @classmethod
    def allocate(cls, capacity: int, device: torch.device | str = "cpu") -> ViolationRing:
        if not 0 <= capacity <= VIOLATION_COUNT_LIMIT:
            raise ValueError(f"kv-canary: ViolationRing capacity must be in [0, {VIOLATION_COUNT_LIMIT}], "
                             f"got {capacity}")
        return cls(
            rows=torch.zeros(capacity, VIOLATION_WIDTH, dtype=torch.int64, device=device),
            write_index=torch.zeros(1, dtype=torch.int32, device=device),
        )

    def reset(self) -> None:
        self.rows.zero_()
        self.write_index.zero_()


def allocate_counters(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [NUM_LAUNCH_TAGS, 2]: per launch tag, (launches run, entries processed)."""
    return torch.zeros(NUM_LAUNCH_TAGS, 2, dtype=torch.int64, device=device)


def allocate_canary_buffer(num_slots: int, stride: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Zero-initialised uint8 [num_slots, stride] canary buffer."""
    return torch.zeros(num_slots, stride, dtype=torch.uint8, device=device)
