"""Triton-specific checks: no recompiles across batch sizes, hash constants on device, misaligned sources.

Bit-exactness against the reference over case tables and fuzz lives in
test_ops_cases.py / test_ops_fuzz.py; these cover what only the Triton path has.
"""

import inspect

import pytest
import torch

from conftest import HAS_TRITON
from kvcanary import ops
from kvcanary.format import CHAIN_HEAD, RealKvMode, chain_hashes, to_signed
from kvcanary.ops import Plan, RealKvSource, ViolationRing, allocate_canary_buffer, allocate_counters

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")

KERNELS = ("_plan_kernel", "_write_kernel", "_verify_kernel", "_scatter_kernel", "_fingerprint_kernel",
           "_write_lanes_kernel")
STEP_KERNELS = ("_plan_kernel", "_write_kernel", "_verify_kernel", "_write_lanes_kernel")


def _kernel_module(name: str):
    from kvcanary.ops import triton_kernels, triton_write_lanes

    return triton_write_lanes if name == "_write_lanes_kernel" else triton_kernels


def _specialization(jit_fn, kwargs) -> tuple:
    """What Triton keys a compiled kernel on, computed the way its launcher binder does."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    opts = getattr(jit_fn, "kwargs", None) or {}
    dns = set(getattr(jit_fn, "do_not_specialize", None) or opts.get("do_not_specialize") or ())
    dnsa = set(getattr(jit_fn, "do_not_specialize_on_alignment", None)
               or opts.get("do_not_specialize_on_alignment") or ())
    key = []
    for name, param in inspect.signature(jit_fn.fn).parameters.items():
        if "constexpr" in str(param.annotation):
            key.append((name, kwargs[name]))
        else:
            key.append((name, native_specialize_impl(BaseBackend, kwargs[name], False, name not in dns,
                                                     name not in dnsa)))
    return tuple(key)


@pytest.fixture
def launches(monkeypatch):
    """Record the specialization key of every Triton launch: {kernel name: set of keys}."""
    seen = {name: set() for name in KERNELS}
    for name in KERNELS:
        jit_fn = getattr(_kernel_module(name), name)

        class Recorder:
            def __getitem__(self, grid, jit_fn=jit_fn, name=name):
                def launch(**kwargs):
                    seen[name].add(_specialization(jit_fn, kwargs))
                    return jit_fn[grid](**kwargs)
                return launch

        monkeypatch.setattr(_kernel_module(name), name, Recorder())
    return seen


def _step(device, bs: int, extend: int, dtype: torch.dtype, buf, ring, counters, plan_out, rtt):
    """One plan + write + verify of bs requests extending by `extend` tokens (rows 1..bs)."""
    rows = torch.arange(1, bs + 1, device=device, dtype=dtype)
    prefix = torch.full((bs,), 3, device=device, dtype=dtype)
    extend_lens = torch.full((bs,), extend, device=device, dtype=dtype)
    ops.plan(req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend_lens, req_to_token=rtt, out=plan_out,
             backend="triton")
    n = bs * extend
    loc = (torch.arange(n, device=device) + 100).to(dtype)
    positions = (torch.arange(n, device=device) % extend + 3).to(dtype)
    ops.write(buf=buf, plan=plan_out, num_requests=bs, out_cache_loc=loc, input_ids=loc, positions=positions,
              ring=ring, counters=counters, launch_tag=0, chain_check=torch.ones(1, dtype=torch.int32, device=device),
              backend="triton")
    ops.verify(buf=buf, entries=plan_out.entries, ring=ring, counters=counters, launch_tag=2, backend="triton")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_new_batch_sizes_do_not_recompile(device, launches, dtype, monkeypatch):
    from kvcanary.ops import triton_ops

    monkeypatch.setattr(triton_ops, "WRITE_LANES_MAX_RATIO", 1)  # (the default; KVCANARY_TEST_WRITE_LANES=0 sets 0)
    buf = allocate_canary_buffer(1024, 48, device)
    ring, counters = ViolationRing.allocate(16, device), allocate_counters(device)
    plan_out = Plan.allocate(4096, 64, device)
    rtt = torch.arange(64 * 32, device=device, dtype=dtype).view(64, 32)
    for bs, extend in ((2, 1), (3, 5), (17, 1), (32, 2), (5, 16), (33, 7)):
        _step(device, bs, extend, dtype, buf, ring, counters, plan_out, rtt)
    for name in STEP_KERNELS:  # (decode-shaped writes take the lane kernel, the others the block one)
        assert len(launches[name]) == 1, (name, launches[name])


@pytest.mark.gpu
def test_kernel_cache_stable_on_gpu(monkeypatch):
    from kvcanary.ops import triton_ops

    monkeypatch.setattr(triton_ops, "WRITE_LANES_MAX_RATIO", 1)  # (the default; KVCANARY_TEST_WRITE_LANES=0 sets 0)
    device = torch.device("cuda")
    buf = allocate_canary_buffer(1024, 48, device)
    ring, counters = ViolationRing.allocate(16, device), allocate_counters(device)
    plan_out = Plan.allocate(4096, 64, device)
    rtt = torch.arange(64 * 32, device=device, dtype=torch.int32).view(64, 32)

    def compiled() -> dict:
        return {name: sum(len(c[0]) for c in getattr(_kernel_module(name), name).device_caches.values())
                for name in STEP_KERNELS}

    # one decode-shaped step (the lane write kernel) and one prefill-shaped (the block one) compile each kernel
    # once; what the worker compiled before this test must not decide the answer
    _step(device, 2, 1, torch.int32, buf, ring, counters, plan_out, rtt)
    _step(device, 2, 3, torch.int32, buf, ring, counters, plan_out, rtt)
    before = compiled()
    for bs, extend in ((3, 5), (17, 1), (32, 2), (1, 1), (33, 7)):
        _step(device, bs, extend, torch.int32, buf, ring, counters, plan_out, rtt)
    assert compiled() == before


def test_chain_vector_and_constants(device):
    """SPEC 3.1 vectors through the write kernel: the 64-bit multipliers survive compilation."""
    buf = allocate_canary_buffer(8, 32, device)
    plan_out = Plan.allocate(4, 1, device)
    plan_out.write_offsets[:2] = torch.tensor([0, 3])
    ring, counters = ViolationRing.allocate(4, device), allocate_counters(device)
    ids = torch.tensor([11, 22, 33], device=device)
    ops.write(buf=buf, plan=plan_out, num_requests=1, out_cache_loc=torch.tensor([1, 2, 3], device=device),
              input_ids=ids, positions=torch.arange(3, device=device), ring=ring, counters=counters, launch_tag=0,
              backend="triton")
    stored = buf.view(torch.int64)[1:4, 2].tolist()
    assert stored == [to_signed(h) for h in chain_hashes([11, 22, 33])]
    assert stored[0] == to_signed(CHAIN_HEAD)


def test_fingerprint_vector_aligned_and_misaligned(device):
    """SPEC 3.4 example, once from an 8-byte aligned base and once from an odd address (byte path)."""
    want = to_signed(0xD6D75024DFD6C30C)
    raw = torch.zeros(64, dtype=torch.uint8, device=device)
    for offset in (0, 16, 1):
        raw.zero_()
        raw[offset:offset + 16] = torch.arange(16, dtype=torch.uint8)
        src = RealKvSource(raw[offset:offset + 32].view(1, 32), 1, 16, 16)
        got = ops.fingerprint(torch.tensor([0, 1, -1], device=device), [src], RealKvMode.PARTIAL, backend="triton")
        assert got.tolist() == [want, 0, 0], offset


def test_direct_launch_steps_aside_only_for_a_real_launch_hook():
    # Triton 3.6+ keeps an empty hook chain in launch_enter_hook by default: that is no hook (the direct
    # launcher may run); a chain with a hook in it, or a plain callable, is one (a profiler must see launches).
    knobs = pytest.importorskip("triton.knobs")
    from kvcanary.ops import triton_ops

    orig = knobs.runtime.launch_enter_hook
    try:
        chain = knobs.HookChain()
        knobs.runtime.launch_enter_hook = chain
        assert not triton_ops._launch_hooked()
        chain.add(lambda *args: None)
        assert triton_ops._launch_hooked()
        knobs.runtime.launch_enter_hook = None
        assert not triton_ops._launch_hooked()
        knobs.runtime.launch_enter_hook = lambda *args: None
        assert triton_ops._launch_hooked()
    finally:
        knobs.runtime.launch_enter_hook = orig


# The TAIL write's chain hint (ops.write chain_hint): Triton copies a request's chain fields from the hint
# when it holds exactly what the serial walk stores, and walks otherwise. The bytes must never differ.

HINT_SLOTS = 512


def _hint_case(variant: str, device):
    """(base buffer, plan, inputs): request 0 continues a seeded chain with 300 entries (three blocks),
    request 1 starts a chain with 5, request 2 writes nothing; ``variant`` plants the awkward input."""
    from ops_harness import clean_chain, poisoned_plan

    base = allocate_canary_buffer(HINT_SLOTS, 48, device)
    clean_chain(base, [3, 4], [11, 12], start_pos=0)
    locs = list(range(100, 400)) + [40, 41, 42, 43, 44]
    ids = [(7 * i) % 1000 for i in range(300)] + [5, 6, 7, 8, 9]
    pos = list(range(2, 302)) + list(range(5))
    if variant == "dup-slot":
        locs[150] = locs[149]
    if variant == "negative-slot":
        locs[200] = -1
    if variant == "slot-past-buffer":
        locs[10] = HINT_SLOTS + 3
    plan = poisoned_plan(4, 4, device)
    plan.write_offsets[:4] = torch.tensor([0, 300, 305, 305], device=device)
    plan.seed_slot[:3] = torch.tensor([4, -1, -1], device=device)
    inputs = [torch.tensor(x, dtype=torch.int64, device=device) for x in (locs, ids, pos)]
    return base, plan, inputs


def _hint_write(buf, plan, inputs, sources, backend, hint=None):
    ring, counters = ViolationRing.allocate(8, buf.device), allocate_counters(buf.device)
    loc, ids, pos = inputs
    ops.write(buf=buf, plan=plan, num_requests=3, out_cache_loc=loc, input_ids=ids, positions=pos, ring=ring,
              counters=counters, launch_tag=1, sources=sources, real_kv_mode=RealKvMode.PARTIAL if sources else 0,
              writer_ids=torch.tensor([9, 8, 7], device=buf.device), step=torch.tensor([5], device=buf.device),
              chain_hint=hint, backend=backend)
    return ring, counters


HINT_VARIANTS = ["exact", "prev-flipped", "token-flipped", "seed-differs", "zeros", "dup-slot", "negative-slot",
                 "slot-past-buffer", "with-real-kv"]


@pytest.mark.parametrize("variant", HINT_VARIANTS)
def test_write_chain_hint_never_changes_the_bytes(device, variant):
    from ops_harness import kv_source

    base, plan, inputs = _hint_case(variant, device)
    sources = [kv_source(HINT_SLOTS, device=device)] if variant == "with-real-kv" else []
    head = base.clone()
    _hint_write(head, plan, inputs, sources, "reference")  # HEAD: the same entries, before the forward
    words = head.view(torch.int64)
    if variant == "prev-flipped":
        words[250, 2] ^= 1  # an entry of request 0 in its third block
    if variant == "token-flipped":
        words[42, 0] += 1  # request 1
    if variant == "zeros":
        head.zero_()
    tail = base.clone()
    if variant == "seed-differs":
        tail.view(torch.int64)[4, 0] += 1  # TAIL's seed record differs: its walk differs from HEAD's chain
    want, want_ring = tail.clone(), None
    want_ring, want_counters = _hint_write(want, plan, inputs, sources, "reference")
    got = tail.clone()
    got_ring, got_counters = _hint_write(got, plan, inputs, sources, "triton", hint=head)
    assert torch.equal(got, want)
    assert torch.equal(got_counters, want_counters)
    assert int(got_ring.write_index[0]) == int(want_ring.write_index[0]) == 0


def test_write_chain_hint_must_match_the_buffer(device):
    base, plan, inputs = _hint_case("exact", device)
    with pytest.raises(ValueError, match="chain_hint"):
        _hint_write(base, plan, inputs, [], "triton", hint=base[:-1].clone())


def test_the_fast_launchers_key_tells_apart_what_triton_specialises_on():
    # The launcher reuses a compiled kernel for arguments of the same key (triton_ops._spec): two arguments
    # Triton would compile apart (dtype, 16-byte alignment, an int's value 1, divisibility by 16 or width)
    # must never share one.
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from kvcanary.ops.triton_ops import _spec

    base = torch.zeros(64, dtype=torch.int64)
    values = [base, base[1:], base[2:], base.view(torch.int32), base.view(torch.uint8)[8:],
              torch.nn.Parameter(torch.zeros(4)), torch.zeros(4, dtype=torch.bfloat16),
              0, 1, 2, 16, 17, 32, (1 << 31) - 1, 1 << 31, (1 << 40) + 16, -1, -16]
    for i, a in enumerate(values):
        for b in values[:i]:
            theirs = [native_specialize_impl(BaseBackend, x, False, True, True) for x in (a, b)]
            if theirs[0] != theirs[1]:
                assert _spec(a) != _spec(b), (a, b, theirs)
    assert _spec((base, 16)) != _spec((base[1:], 16)) and _spec(True) != _spec(1) and _spec(None) is None
