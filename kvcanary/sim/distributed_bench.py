"""Cost of the distributed checks at engine sizes, on each rank's device (GPU with NCCL).

Every rank builds a ``Canary`` over a pool of ``num_slots`` slots (16-token pages, 256
bytes of K per token as the real-KV source) and runs one ``tokens``-token prefill
through it. Then:
- consistency: ``ConsistencyCheck.exchange`` (digests of the TAIL K buffer, counters,
  violations; one ``all_gather``) timed on every rank;
- transfer: rank 0 packs the request's records and sends them with its KV pages to
  rank 1 (``send_transfer``); rank 1 receives, copies the pages into other slots, lands
  the records, and runs the ``ArrivalCheck`` through its own table.
Times are means over ``repeats`` after a warm-up, with the device synchronized around each.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from kvcanary.distributed import (ArrivalCheck, ConsistencyCheck, land_records, pack_records, recv_transfer,
                                  send_transfer)
from kvcanary.ops import RealKvSource
from kvcanary.runtime import Canary, CanaryConfig, ForwardBatch, PoolSpec

PAGE = 16
TOKEN_BYTES = 256


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev, repeats: int) -> float:
    for _ in range(2):
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / repeats


def _canary(num_slots: int, tokens: int, dev: torch.device):
    g = torch.Generator().manual_seed(0)
    k = torch.randint(-2**15, 2**15, (num_slots // PAGE, PAGE * TOKEN_BYTES // 2), generator=g,
                      dtype=torch.int16).to(dev)
    pool = PoolSpec(num_slots, k_sources=(RealKvSource(k, PAGE, TOKEN_BYTES, TOKEN_BYTES),))
    canary = Canary(pool, CanaryConfig(mode="log", real_kv="partial", health_interval=0), max_batch=1,
                    max_tokens=tokens, max_context=tokens, num_rows=2, device=dev)
    slots = torch.arange(PAGE, PAGE + tokens, device=dev)
    table = torch.zeros(2, tokens, dtype=torch.int32, device=dev)
    table[1] = slots.to(torch.int32)
    ids = torch.randint(1, 32000, (tokens,), generator=g).to(dev)
    one = lambda x: torch.tensor([x], device=dev)  # noqa: E731
    batch = ForwardBatch(one(1), one(0), one(tokens), ids, torch.arange(tokens, device=dev), slots, table,
                         request_ids=one(1))
    canary.before_forward(batch)
    canary.after_forward(batch)
    return canary, k, slots, ids


def bench_costs(ctx, num_slots: int, tokens: int, repeats: int = 20) -> dict | None:
    """Collective over the default group; rank 0 returns {"slots", "tokens", "exchange_s", "check_s", "transfer_s"}."""
    dev = ctx.device
    num_slots = max(-(-num_slots // PAGE) * PAGE, 4 * PAGE + 2 * tokens)
    canary, k, slots, ids = _canary(num_slots, tokens, dev)
    check = ConsistencyCheck(canary, interval=1, device=dev)
    exchange_s = _timed(lambda: check.exchange(settled=None), dev, repeats)
    pages = slots[::PAGE] // PAGE
    new_pages = pages + pages.shape[0]
    new_slots = slots + pages.shape[0] * PAGE
    table = torch.zeros(tokens, dtype=torch.int64, device=dev)
    transfer_s = check_s = 0.0
    if ctx.rank == 0:
        def send():
            packet = pack_records(canary, slots, ids, 1)
            send_transfer(packet, [k[pages]], 1, dev)
        for _ in range(repeats + 2):
            send()
    elif ctx.rank == 1:
        arrival = ArrivalCheck(canary, instance="decode")
        got = {}

        def receive():
            packet, (kv,) = recv_transfer(0, dev)
            k[new_pages] = kv
            land_records(canary, packet, new_slots)
            table.copy_(new_slots)
            got["packet"] = packet
        transfer_s = _timed(receive, dev, repeats)
        check_s = _timed(lambda: arrival.check(got["packet"], table, src_rank=0), dev, repeats)
        if arrival.total:
            raise RuntimeError(f"kv-canary: the benchmark's clean transfer must verify clean, got {arrival.total} "
                               "violations")
    times = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object((exchange_s, transfer_s, check_s), times, dst=0)
    if ctx.rank != 0:
        return None
    return {"slots": num_slots, "tokens": tokens, "exchange_s": max(t[0] for t in times),
            "transfer_s": times[1][1], "check_s": times[1][2]}
