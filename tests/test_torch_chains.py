"""Long write chains: the torch backend's Python-integer CPU path and its vectorised accelerator path
both give the reference's bits."""

import pytest
import torch

from kvcanary import ops
from kvcanary.format import LaunchTag, RealKvMode
from kvcanary.ops import torch_ops

from ops_harness import static_shapes


def _write(backend, lengths, seeds, slots, buf0):
    buf = buf0.clone()
    ring = ops.ViolationRing.allocate(64)
    counters = ops.allocate_counters()
    plan = ops.Plan.allocate(1, len(lengths))
    offs = torch.tensor([0] + lengths).cumsum(0)
    plan.write_offsets[:len(lengths) + 1] = offs
    plan.seed_slot[:len(lengths)] = torch.tensor(seeds)
    n = int(offs[-1])
    pos = torch.cat([torch.arange(10, 10 + k) for k in lengths])
    ids = (torch.arange(n) * 7919) % 1000
    kv = torch.arange(buf.shape[0] * 16, dtype=torch.int64).view(buf.shape[0], 16).to(torch.uint8)
    src = ops.RealKvSource(kv, 1, 16, 16)
    ops.write(buf=buf, plan=plan, num_requests=len(lengths), out_cache_loc=torch.tensor(slots),
              input_ids=ids, positions=pos, ring=ring, counters=counters, launch_tag=LaunchTag.TAIL_K_FULL,
              sources=(src,), real_kv_mode=RealKvMode.ALL, chain_check=torch.tensor([1], dtype=torch.int32),
              writer_ids=torch.arange(len(lengths)), step=torch.tensor([3]), backend=backend)
    return buf, ring.rows, ring.write_index, counters


@pytest.mark.parametrize("static", [False, True], ids=["cpu-path", "accelerator-path"])
@pytest.mark.parametrize("case", ["independent", "seed-written-earlier-in-launch", "shared-slot"])
def test_long_chains_match_reference(case, static):
    g = torch.Generator().manual_seed(3)
    buf0 = torch.randint(0, 256, (200, 48), generator=g, dtype=torch.uint8)
    lengths = [20, 33, 17]
    slots = list(range(1, 71))
    seeds = [5 + 100, -1, 150]
    if case == "seed-written-earlier-in-launch":
        seeds = [-1, slots[19], slots[20 + 32]]  # request 1 continues request 0, request 2 continues request 1
    if case == "shared-slot":
        slots[40] = slots[3]  # two requests write one slot: the later one wins
    assert max(lengths) > torch_ops.SCALAR_CHAIN_MIN
    ref = _write("reference", lengths, seeds, slots, buf0)
    with static_shapes(static):
        fast = _write("torch", lengths, seeds, slots, buf0)
    for a, b in zip(ref, fast):
        assert torch.equal(a, b)
