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

KERNELS = ("_plan_kernel", "_write_kernel", "_verify_kernel", "_scatter_kernel", "_fingerprint_kernel")


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
    from kvcanary.ops import triton_kernels

    seen = {name: set() for name in KERNELS}
    for name in KERNELS:
        jit_fn = getattr(triton_kernels, name)

        class Recorder:
            def __getitem__(self, grid, jit_fn=jit_fn, name=name):
                def launch(**kwargs):
                    seen[name].add(_specialization(jit_fn, kwargs))
                    return jit_fn[grid](**kwargs)
                return launch

        monkeypatch.setattr(triton_kernels, name, Recorder())
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
def test_new_batch_sizes_do_not_recompile(device, launches, dtype):
    buf = allocate_canary_buffer(1024, 48, device)
    ring, counters = ViolationRing.allocate(16, device), allocate_counters(device)
    plan_out = Plan.allocate(4096, 64, device)
    rtt = torch.arange(64 * 32, device=device, dtype=dtype).view(64, 32)
    for bs, extend in ((2, 1), (3, 5), (17, 1), (32, 2), (5, 16), (33, 7)):
        _step(device, bs, extend, dtype, buf, ring, counters, plan_out, rtt)
    for name in ("_plan_kernel", "_write_kernel", "_verify_kernel"):
        assert len(launches[name]) == 1, (name, launches[name])


@pytest.mark.gpu
def test_kernel_cache_stable_on_gpu():
    from kvcanary.ops import triton_kernels

    device = torch.device("cuda")
    buf = allocate_canary_buffer(1024, 48, device)
    ring, counters = ViolationRing.allocate(16, device), allocate_counters(device)
    plan_out = Plan.allocate(4096, 64, device)
    rtt = torch.arange(64 * 32, device=device, dtype=torch.int32).view(64, 32)

    def compiled() -> dict:
        return {name: sum(len(c[0]) for c in getattr(triton_kernels, name).device_caches.values())
                for name in ("_plan_kernel", "_write_kernel", "_verify_kernel")}

    _step(device, 2, 1, torch.int32, buf, ring, counters, plan_out, rtt)
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
