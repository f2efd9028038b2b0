"""The device half of the Canary captured in a CUDA graph: replays stay clean, corruption is reported."""

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolSpec, RealKvSource

pytestmark = pytest.mark.gpu

BS, CTX, SLOTS, DIM = 4, 64, 512, 16


def _static(device):
    return {
        "rows": torch.arange(1, BS + 1, dtype=torch.int64, device=device),
        "prefix": torch.zeros(BS, dtype=torch.int64, device=device),
        "extend": torch.ones(BS, dtype=torch.int64, device=device),
        "ids": torch.zeros(BS, dtype=torch.int64, device=device),
        "pos": torch.zeros(BS, dtype=torch.int64, device=device),
        "loc": torch.zeros(BS, dtype=torch.int64, device=device),
        "rids": torch.arange(100, 100 + BS, dtype=torch.int64, device=device),
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graph_replay_clean_then_corruption_reported(backend):
    device = torch.device("cuda")
    kv = torch.zeros(SLOTS, DIM, dtype=torch.bfloat16, device=device)
    pool = PoolSpec(SLOTS, (RealKvSource(kv, 1, DIM * 2, DIM * 2),))
    canary = Canary(pool, CanaryConfig(backend=backend, warmup_steps=0), max_batch=BS, max_tokens=BS,
                    max_context=CTX, num_rows=BS + 1, device=device)
    rtt = torch.zeros(BS + 1, CTX, dtype=torch.int32, device=device)
    s = _static(device)
    batch = ForwardBatch(s["rows"], s["prefix"], s["extend"], s["ids"], s["pos"], s["loc"], rtt,
                         request_ids=s["rids"])

    def toy_forward():
        kv.index_copy_(0, s["loc"], (s["ids"] * 7 + s["pos"]).to(torch.bfloat16)[:, None].expand(BS, DIM).contiguous())

    def load_step(step):
        # Host-side scheduling of decode step `step`: request r writes position step into slot 1 + r * CTX + step.
        loc = torch.tensor([1 + r * (SLOTS // (BS + 1)) + step for r in range(BS)], device=device)
        s["prefix"].fill_(step)
        s["pos"].fill_(step)
        s["ids"].copy_(torch.tensor([(r * 31 + step * 7) % 1000 for r in range(BS)], device=device))
        s["loc"].copy_(loc)
        rtt[1:, step] = loc.to(torch.int32)

    # Warm-up eagerly (compiles kernels), then capture device_before + forward + device_after.
    load_step(0)
    canary.before_forward(batch)
    toy_forward()
    canary.after_forward(batch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        load_step(1)
        canary.device_before(batch)
        toy_forward()
        canary.device_after(batch)
    torch.cuda.current_stream().wait_stream(side)
    canary.host_before(batch)
    canary.host_after(batch)
    with torch.cuda.graph(graph):
        canary.device_before(batch)
        toy_forward()
        canary.device_after(batch)
    canary.mark_ready()
    for step in range(2, 12):
        load_step(step)
        canary.host_before(batch)
        graph.replay()
        canary.host_after(batch)
    assert canary.flush() == []
    launches = canary.stats()["launches"]
    assert launches["HEAD_K_FULL"] >= 2 * 11 and launches["TAIL_K_FULL"] >= 2 * 11
    # Plant: request 2's table cell at position 3 points at request 1's slot.
    rtt[2, 3] = rtt[1, 3]
    load_step(12)
    canary.host_before(batch)
    graph.replay()
    canary.host_after(batch)
    vs = canary.flush()
    assert vs and {v.slot for v in vs} == {int(rtt[1, 3]), int(rtt[2, 4])}
    assert all("verify_chain_hash" in v.reasons for v in vs)


def test_replay_of_a_captured_graph_is_its_replay():
    """``graphs.replay_of``: the C replay of a torch CUDA graph (no Python wrapper) runs the captured work
    each call, as ``graph.replay()`` does; a stand-in graph keeps its own method."""
    from kvcanary.runtime.graphs import DispatchGraph, replay_of

    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        x.add_(1)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    replay = replay_of(graph)
    assert replay != graph.replay  # the C method, bound to this graph
    replay()
    replay()
    graph.replay()
    assert x.tolist() == [3.0] * 4
    stand_in = DispatchGraph()
    assert replay_of(stand_in) == stand_in.replay
