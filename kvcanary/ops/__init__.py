"""The canary ops of SPEC section 4 and the adapter's read table, each with reference, torch, numba and Triton
implementations; the allocator check (reference and torch)."""

from kvcanary.ops.allocator_ops import check_allocator

from kvcanary.ops.api import (
    BACKENDS,
    accept_rewrites,
    fill_entries,
    fingerprint,
    launch_scatter_req_token_ids_kernel,
    plan,
    read_table,
    resolve_backend,
    scatter_req_token_ids,
    verify,
    write,
)
from kvcanary.ops.types import (
    NO_LIMIT,
    Entries,
    Plan,
    RealKvSource,
    ViolationRing,
    allocate_canary_buffer,
    allocate_counters,
)

__all__ = [
    "BACKENDS",
    "NO_LIMIT",
    "Entries",
    "Plan",
    "RealKvSource",
    "ViolationRing",
    "accept_rewrites",
    "allocate_canary_buffer",
    "allocate_counters",
    "check_allocator",
    "fill_entries",
    "fingerprint",
    "launch_scatter_req_token_ids_kernel",
    "plan",
    "read_table",
    "resolve_backend",
    "scatter_req_token_ids",
    "verify",
    "write",
]
