"""Multi-process runs over gloo: 2 and 3 ranks, every planted distributed bug, transport, deadlines.

Each test spawns its own process group (fork on Linux, so the children reuse the imported
torch); a deadline turns a hung collective into a failure.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from kvcanary.cli import main
from kvcanary.distributed import RecordPacket, recv_transfer, send_transfer, spawn
from kvcanary.sim.distributed import DIST_BUGS, run_distributed, verdict

SMALL = dict(num_requests=6, max_steps=60)


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(2, interval=8, timeout_s=240, **SMALL)


def test_every_distributed_bug_is_detected_and_clean_runs_stay_clean(two_ranks):
    by_bug = {}
    for r in two_ranks.results:
        by_bug.setdefault(r["bug"], []).append(r)
    assert set(by_bug) == {None, *DIST_BUGS}
    assert {r["kind"] for r in by_bug[None]} == {"tp", "pd"}
    for r in by_bug[None]:
        assert verdict(r) == "clean" and r["violations"] == 0 and not r.get("divergences")
        assert r.get("arrival_violations", 0) == 0
    for bug in DIST_BUGS:
        (r,) = by_bug[bug]
        assert verdict(r) == "detected", (bug, r)
        assert r["first_detected_step"] >= r["planted_step"]
    assert two_ranks.ok


def test_tp_bugs_name_the_rank_they_were_planted_on(two_ranks):
    runs = {r["bug"]: r for r in two_ranks.results if r["kind"] == "tp" and r["bug"]}
    alloc = runs["tp_divergent_allocator"]
    assert alloc["named"] == [1] and alloc["divergences"][0]["fields"] == ["records:full"]
    assert alloc["violations"] == 0  # each rank is self-consistent: only the exchange can see it
    copy = runs["tp_skipped_copy"]
    assert copy["named"] == [1] and copy["violations_by_rank"][0] == 0 < copy["violations_by_rank"][1]
    assert copy["rows"] and all(x.startswith("kv_canary violation: rank=1 instance=tp ") for x in copy["rows"])


def test_pd_bugs_are_named_by_the_decode_instance(two_ranks):
    for r in two_ranks.results:
        if r["kind"] == "pd" and r["bug"]:
            assert r["named"] == [1] and r["arrival_violations"] > 0, r["bug"]
            assert all(x.startswith("kv_canary transfer violation: instance=decode rank=1 src_rank=0 ")
                       for x in r["arrival_rows"])
            assert r["violations_by_rank"][0] == 0  # the prefill side did nothing wrong
            assert r["transfers"] == SMALL["num_requests"]


def test_costs_are_measured(two_ranks):
    c = two_ranks.costs()
    assert c["consistency_exchange_s"] > 0 and 0 < c["consistency_local_s"] <= c["consistency_exchange_s"]
    assert c["transfer_check_s"] > 0 and c["transfer_land_s"] > 0


def test_three_ranks_name_the_middle_rank_by_majority():
    report = run_distributed(3, bugs=["tp_divergent_allocator"], clean=False, interval=8, timeout_s=240, **SMALL)
    (r,) = report.results
    assert verdict(r) == "detected" and r["named"] == [1]
    assert r["divergences"][0]["reference"] == "majority of 3"


def test_cli_distributed_zoo_json(capsys):
    code = main(["zoo", "--distributed", "--bug", "pd_partial", "--interval", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] and out["backend"] == "gloo" and out["world_size"] == 2
    assert [r["verdict"] for r in out["results"]] == ["clean", "clean", "clean", "detected"]
    assert out["costs"]["transfer_check_s"] > 0
    bug_run = out["results"][-1]
    assert bug_run["arrival_violation_rows"][0]["rank"] == 1 and bug_run["arrival_violation_rows"][0]["src_rank"] == 0
    assert {row["rank"] for row in bug_run["violation_rows"]} == {1}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_the_distributed_zoo_on_nccl():
    report = run_distributed(2, backend="nccl", interval=8, timeout_s=300, bench_slots=1 << 16, **SMALL)
    assert report.ok and report.bench["check_s"] > 0 and report.device != "cpu"


def _roundtrip(ctx):
    """Rank 0 sends a packet with odd KV tensors to rank 1, which sends back what it received."""
    g = torch.Generator().manual_seed(3)
    packet = RecordPacket(41, 2, torch.tensor([5, 6, 7]), torch.randint(0, 256, (2, 3, 48), generator=g,
                                                                       dtype=torch.uint8))
    kv = [torch.randn(2, 3, 5, generator=g).to(torch.bfloat16), torch.randint(-9, 9, (7, 1), dtype=torch.int8)]
    if ctx.rank == 0:
        send_transfer(packet, kv, 1)
        back, back_kv = recv_transfer(1)
        return {"id": back.request_id, "start": back.start, "tokens": torch.equal(back.tokens, packet.tokens),
                "records": torch.equal(back.records, packet.records),
                "kv": [torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back_kv, kv)]}
    got, got_kv = recv_transfer(0)
    send_transfer(got, got_kv, 0)
    return None


def test_records_and_kv_travel_byte_for_byte():
    out = spawn(_roundtrip, 2, timeout_s=60)
    assert out == {"id": 41, "start": 2, "tokens": True, "records": True, "kv": [True, True]}


def _hang(ctx):
    time.sleep(60)


def _fail(ctx):
    if ctx.rank == 1:
        raise KeyError("planted failure on rank 1")
    time.sleep(60)


def test_a_hung_run_times_out_and_a_failed_rank_is_reported():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="within 3"):
        spawn(_hang, 2, timeout_s=3)
    with pytest.raises(RuntimeError, match="planted failure on rank 1"):
        spawn(_fail, 2, timeout_s=30)
    assert time.monotonic() - t0 < 25


def _finish_after_a_raising_flush(ctx):
    """Rank 1's last drain raises (mode raise: violations it alone found); both ranks still meet in the exchange."""
    from kvcanary import Canary, CanaryConfig, PoolSpec, RealKvSource
    from kvcanary.distributed import ConsistencyCheck
    from kvcanary.runtime.report import KvCanaryViolationError

    k = torch.zeros(16, 8)
    pool = PoolSpec(16, k_sources=(RealKvSource(k, page_size=1, num_bytes_per_token=32, read_bytes=32),))
    canary = Canary(pool, CanaryConfig(mode="raise", backend="torch"), max_batch=2, max_tokens=8, max_context=8,
                    num_rows=2)
    check = ConsistencyCheck(canary, interval=0)
    if ctx.rank == 1:
        def flush():
            raise KvCanaryViolationError([], 1)

        canary.flush = flush
        with pytest.raises(KvCanaryViolationError):
            check.finish()
    else:
        check.finish()
    assert check.exchanges == 1
    return check.exchanges


def test_finish_is_a_collective_even_where_the_last_drain_raises():
    assert spawn(_finish_after_a_raising_flush, 2, timeout_s=40) == 1
