"""Bit-exact on-device format of kv-canary (SPEC section 3).

Everything a kernel, a reader of a dumped buffer or another implementation
needs to agree on lives here: record and violation layouts, reason bits,
launch tags, real-KV modes, padding conventions and the hash functions as
plain Python integers (the readable definition every kernel is tested against).
"""

from __future__ import annotations

import enum

MASK64 = (1 << 64) - 1

SPLITMIX_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX_MUL2 = 0x94D049BB133111EB
CHAIN_ANCHOR = 0xC0FFEE1234567890
# splitmix64(CHAIN_ANCHOR): the prev_hash a chain head stores.
CHAIN_HEAD = 0xDE7FAE23A9A1B716


class RecordField(enum.IntEnum):
    """int64 fields of one canary record (one record per slot and buffer)."""

    TOKEN = 0
    POSITION = 1
    PREV_HASH = 2
    REAL_KV_HASH = 3
    # Project extensions (SPEC 3.2 leaves index 4+ to the implementation).
    WRITER_ID = 4
    WRITER_STEP = 5


SPEC_RECORD_BYTES = 32
# Default stride: the four SPEC fields plus writer id and writer step.
DEFAULT_RECORD_STRIDE = 48
# A buffer stores attribution (WRITER_ID, WRITER_STEP) only when this wide.
ATTRIBUTION_STRIDE = 48


class ViolationField(enum.IntEnum):
    """int64 columns of one violation row."""

    KIND = 0
    SLOT = 1
    POSITION = 2
    STORED_TOKEN = 3
    EXPECTED_TOKEN = 4
    STORED_CHAIN_HASH = 5
    EXPECTED_AUX = 6
    FAIL_REASON = 7


VIOLATION_WIDTH = 8
# The ring's int32 count saturates here instead of wrapping negative: a wrapped count would index
# before the ring. Far above any capacity, and far enough below 2**31 that adds racing the clamp
# on the GPU never overflow.
VIOLATION_COUNT_LIMIT = 1 << 30


class FailReason(enum.IntFlag):
    VERIFY_CHAIN_HASH = 1
    VERIFY_POSITION = 2
    VERIFY_REAL_KV_HASH = 4
    WRITE_TOKEN = 8
    WRITE_POSITION = 16
    VERIFY_TOKEN = 32
    # Project extensions: runtime slot checks (kvcanary/runtime/slots.py, docs/slots.md), never set by the ops.
    RESERVED_SLOT_READ = 64
    RESERVED_SLOT_WRITE = 128
    NONFINITE_KV = 256
    READ_PAST_LENGTH = 512
    # Project extensions: the write and attention-metadata checks (kvcanary/runtime/write_check.py,
    # kvcanary/runtime/attention_check.py, docs/write_check.md), never set by the record ops.
    WRITE_KV = 1024
    ATTENTION_MASK = 2048
    KEY_LENGTH = 4096


def reason_label(bits: int) -> str:
    """Lower-case names of the set reason bits joined with '+', e.g. 'verify_chain_hash+verify_position'."""
    names = [r.name.lower() for r in FailReason if bits & int(r)]
    unknown = bits & ~sum(int(r) for r in FailReason)
    if unknown:
        names.append(f"unknown_0x{unknown:x}")
    return "+".join(names) if names else "none"


class LaunchTag(enum.IntEnum):
    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11


NUM_LAUNCH_TAGS = len(LaunchTag)


class Counter(enum.IntEnum):
    """Columns of the int64 [NUM_LAUNCH_TAGS, 2] counter table."""

    LAUNCHES = 0
    ENTRIES = 1


def launch_tag(phase: str, kv: str, group: str) -> LaunchTag:
    """Tag from its parts: phase 'head'|'tail'|'sweep', kv 'k'|'v', group 'full'|'swa'."""
    return LaunchTag[f"{phase.upper()}_{kv.upper()}_{group.upper()}"]


class RealKvMode(enum.IntEnum):
    NONE = 0
    PARTIAL = 1  # first 16 bytes of the token's KV
    ALL = 2  # read_bytes of the token's KV


PARTIAL_READ_BYTES = 16
MAX_REAL_KV_SOURCES = 4

# Padding conventions.
PAD_ROW = 0  # req_to_token row 0 is the padding row
PAD_SLOT = 0  # slot 0 takes padded-token writes and is never verified
NO_PREV = -1  # prev slot of position 0: the chain head
UNREACHABLE_PREV = 0  # prev slot 0 (evicted SWA predecessor): chain check skipped
NO_EXPECTED_TOKEN = -1  # expected token not known: token check skipped
NO_SEED = -1  # write chain without a predecessor starts at CHAIN_HEAD


def splitmix64(x: int) -> int:
    x &= MASK64
    x ^= x >> 30
    x = (x * SPLITMIX_MUL1) & MASK64
    x ^= x >> 27
    x = (x * SPLITMIX_MUL2) & MASK64
    x ^= x >> 31
    return x


def mix3(a: int, b: int, c: int) -> int:
    h = splitmix64(a)
    h = splitmix64(h ^ (b & MASK64))
    return splitmix64(h ^ (c & MASK64))


def link(prev_hash: int, token: int, position: int) -> int:
    """Hash a successor stores as prev_hash: mix3 over this record's (prev_hash, token, position)."""
    return mix3(prev_hash, token, position)


def to_signed(x: int) -> int:
    """uint64 bit pattern -> the int64 value stored on device."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def to_unsigned(x: int) -> int:
    return x & MASK64


def chain_hashes(tokens: list[int], positions: list[int] | None = None) -> list[int]:
    """prev_hash values a clean chain stores for tokens at positions (default 0..n-1)."""
    positions = list(range(len(tokens))) if positions is None else positions
    out, running = [], CHAIN_HEAD
    for tok, pos in zip(tokens, positions):
        out.append(running)
        running = link(running, tok, pos)
    return out


def oracle_token(request_id: int, position: int, vocab_size: int) -> int:
    """Token oracle of SPEC 5: splitmix64(request_id ^ position) mod vocab (unsigned)."""
    return splitmix64((request_id ^ position) & MASK64) % vocab_size
