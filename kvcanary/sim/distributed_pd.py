"""Prefill/decode disaggregation on the simulated engine: two engines, two ranks, one transfer each request.

The prefill rank runs the workload through a ``SimEngine`` that stops every request
after its prefill: the request's KV pages, its canary records (``pack_records``) and
its tokens go to the decode rank (``send_transfer``), and the prefill side releases it
into its prefix cache. The decode rank's ``SimEngine`` has no workload of its own: an
arrived request gets a row and fresh pages of the decode pool, its KV is copied in
(on a copy stream the engine waits on), its records land at the new slots
(``land_records``), the ``ArrivalCheck`` verifies it through the decode table, and it
joins the running batch. Every engine step the prefill rank sends a header (arrivals,
done) so both ranks stay in step.

Planted bugs, all on the decode side's receive path:
- ``pd_page_order``: the KV pages land in the wrong order (the first two swapped).
- ``pd_wrong_slots``: the KV lands at the prefill side's slot numbers, not the new ones.
- ``pd_partial``: the last page never arrives and the transfer counts as complete.
- ``pd_table_other``: the decode table row points at slots that hold another request's KV.
- ``pd_read_early``: the engine reads the request before its KV copy completed (no wait).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from kvcanary.distributed import (ArrivalCheck, gather_violations, land_records, pack_records, recv_transfer,
                                  send_transfer)
from kvcanary.sim.config import SimConfig
from kvcanary.sim.engine import SimEngine
from kvcanary.sim.offload import CopyStream
from kvcanary.sim.request import Request, State


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def prefill_side(engine: SimEngine, dst: int, device, timing: dict, group=None) -> None:
    """Run the workload, handing each request to rank ``dst`` as soon as its prefill completed."""
    cfg = engine.cfg
    while True:
        idle = not engine.sched.busy and engine.step_no > engine.workload.last_arrival
        done = engine.step_no >= cfg.max_steps or idle
        if not done:
            engine.step()
        ready = list(engine.sched.running)
        dist.send(torch.tensor([len(ready), int(done)], dtype=torch.int64, device=device), dst, group=group)
        for r in ready:
            n = r.kv_len
            t0 = time.perf_counter()
            packet = pack_records(engine.canary, _t(r.slots[:n]), _t(r.tokens[:n]), r.rid)
            meta = _t([len(r.prompt), r.max_new, len(r.tokens), *r.tokens, *r.slots[:n]])
            send_transfer(packet, [meta, *engine.model.read(r.slots[:n])], dst, device, group)
            timing["send_s"].append(time.perf_counter() - t0)
            engine.sched.running.remove(r)
            r.state = State.FINISHED
            engine.sched.finished += 1
            engine.cache.release(r, insert=True)
        if done:
            return


class DecodeSide:
    """The decode instance: receives transfers, lands them (bugs planted here), checks, decodes."""

    def __init__(self, engine: SimEngine, src: int, rank: int, bug: str | None, timing: dict):
        self.engine, self.src, self.bug, self.timing = engine, src, bug, timing
        self.check = ArrivalCheck(engine.canary, instance="decode", rank=rank)
        self.stream = CopyStream()
        self.waiting: list[tuple] = []  # arrived transfers without a row or pages yet
        self.last_landed: Request | None = None
        self.planted_step: int | None = None
        self.landed = 0

    def _planted(self) -> None:
        # The step of the first decode forward that reads the damaged arrival (the arrival check precedes it).
        if self.planted_step is None:
            self.planted_step = self.engine.canary.step + 1

    def land(self, packet, tensors) -> tuple[Request, object] | None:
        """Give an arrived request a row and pages, copy its KV in and land its records; None without memory."""
        e = self.engine
        meta, kv = tensors[0].tolist(), [t.cpu() for t in tensors[1:]]
        prompt_len, max_new, ntok = meta[:3]
        tokens, src_slots = meta[3:3 + ntok], meta[3 + ntok:]
        n = packet.num_tokens
        if e.pool.rows.free_rows == 0 or not e.cache.free_pages_for(e.pool.pages_needed(0, n) + 1):
            return None
        r = Request(packet.request_id, tokens[:prompt_len], max_new, vocab=e.cfg.vocab, tokens=tokens)
        r.row, r.last_node = e.pool.alloc_row(), e.tree.root
        slots = e.pool.extend(r, n)
        t0 = time.perf_counter()
        target, data, count = slots, kv, n
        ps = e.pool.ps
        if self.bug == "pd_page_order" and n > ps:
            # Planted: the receiver stores the first two pages of the transfer in swapped order.
            k = min(2 * ps, n) - ps
            data = [torch.cat([x[ps:ps + k], x[:ps], x[ps + k:]]) for x in kv]
            self._planted()
        if self.bug == "pd_wrong_slots" and src_slots != slots:
            # Planted: the KV goes to the prefill side's slot numbers instead of the ones just allocated.
            target = src_slots
            self._planted()
        if self.bug == "pd_partial":
            # Planted: the last page is missing and the transfer is taken as complete.
            count = (n - 1) // ps * ps
            if not _same(e.model.read(slots[count:]), [x[count:] for x in kv]):
                self._planted()
        self.stream.issue(lambda: e.model.write(target[:count], [x[:count] for x in data]),
                          lambda: not _same(e.model.read(target[:count]), [x[:count] for x in data]))
        land_records(e.canary, packet, _t(slots))
        self.timing["land_s"].append(time.perf_counter() - t0)
        other = self.last_landed
        if self.bug == "pd_table_other" and other is not None and not other.freed and other.row:
            # Planted: the new request's table row is filled with the slots of the previous arrival.
            m = min(n, other.kv_len)
            e.pool.write_row(r.row, 0, other.slots[:m])
            if other.slots[:m] != slots[:m]:
                self._planted()
        r.state = State.RUNNING
        e.sched.requests[r.rid] = r
        e.sched.running.append(r)
        self.last_landed = r
        self.landed += 1
        return r, packet

    def step(self, arrivals: list) -> None:
        """Land what arrived (and what waited for memory), check the landed, run one decode step."""
        e = self.engine
        self.waiting.extend(arrivals)
        landed = []
        while self.waiting:
            got = self.land(*self.waiting[0])
            if got is None:
                break
            self.waiting.pop(0)
            landed.append(got)
        if self.stream.pending:
            if self.bug != "pd_read_early":
                self.stream.synchronize()  # the transfer's completion event
            elif self.stream.pending_changes():
                self._planted()  # Planted: the request is checked and decoded before its KV copy landed.
        for r, packet in landed:
            self.check.check(packet, e.pool.table[r.row], src_rank=self.src)
        e.step()
        self.stream.synchronize()  # end of step: copies still in flight land now

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.engine.sched.busy


def run_pd(rank: int, world: int, cfg: SimConfig, bug: str | None, device, group=None) -> dict | None:
    """One PD scenario: ranks (2i, 2i + 1) are (prefill, decode) pairs; rank 0 returns the result."""
    pair = rank // 2 * 2
    timing = {"send_s": [], "land_s": []}
    info = {"rank": rank, "role": "idle", "violations": 0, "arrival": [], "planted_step": None,
            "landed": 0, "check": {}, "timing": timing, "arrival_first": None}
    if pair + 1 < world:
        if rank == pair:
            engine = SimEngine(cfg)
            prefill_side(engine, pair + 1, device, timing, group)
            info["role"] = "prefill"
        else:
            engine = SimEngine(cfg.replace(num_requests=0))
            side = DecodeSide(engine, pair, rank, bug, timing)
            done = False
            while not done or side.busy:
                if engine.step_no >= 4 * cfg.max_steps:
                    break
                arrivals = []
                if not done:
                    head = torch.empty(2, dtype=torch.int64, device=device)
                    dist.recv(head, pair, group=group)
                    count, done = head.tolist()
                    arrivals = [recv_transfer(pair, device, group) for _ in range(count)]
                side.step(arrivals)
            info.update(role="decode", arrival=[v.log_line() for v in side.check.violations],
                        arrival_dicts=[v.to_dict() for v in side.check.violations[:10]], landed=side.landed,
                        arrival_total=side.check.total, planted_step=side.planted_step, check=side.check.cost(),
                        arrival_first=min((v.violation.step for v in side.check.violations), default=None))
        engine.canary.flush()
        info["violations"] = engine.canary.monitor.total_violations
        info["first_violation"] = min((v.step for v in engine.canary.violations), default=None)
        rows = gather_violations(engine.canary.violations, info["role"], group=group)
    else:
        rows = gather_violations([], "idle", group=group)
    infos = [None] * world if rank == 0 else None
    dist.gather_object(info, infos, dst=0, group=group)
    if rank != 0:
        return None
    return pd_result(cfg, bug, world, infos, rows)


def pd_result(cfg: SimConfig, bug: str | None, world: int, infos: list[dict], rows) -> dict:
    decode = [i for i in infos if i["role"] == "decode"]
    planted = [i["planted_step"] for i in decode if i["planted_step"] is not None]
    firsts = [s for i in decode for s in (i["first_violation"], i["arrival_first"]) if s is not None]
    send = [s for i in infos for s in i["timing"]["send_s"]]
    land = [s for i in infos for s in i["timing"]["land_s"]]
    checks = [i["check"] for i in decode if i["check"].get("checks")]
    n_checks = sum(c["checks"] for c in checks)
    return {
        "kind": "pd", "bug": bug, "config": cfg.name, "world": world,
        "planted_step": min(planted) if planted else None,
        "first_detected_step": min(firsts) if firsts else None,
        "named": sorted({i["rank"] for i in decode if i.get("arrival_total")}),
        "arrival_violations": sum(i.get("arrival_total", 0) for i in decode),
        "arrival_rows": [x for i in decode for x in i["arrival"][:10]],
        "arrival_violation_rows": [x for i in decode for x in i["arrival_dicts"]],
        "violations": sum(i["violations"] for i in infos),
        "violations_by_rank": {i["rank"]: i["violations"] for i in infos},
        "rows": [r.log_line() for r in rows[:20]],
        "violation_rows": [r.to_dict() for r in rows[:20]],
        "transfers": sum(i["landed"] for i in decode),
        "cost": {"send_s_per_request": sum(send) / len(send) if send else 0.0,
                 "land_s_per_request": sum(land) / len(land) if land else 0.0,
                 "check_s_per_request": sum(c["mean_check_s"] * c["checks"] for c in checks) / n_checks
                 if n_checks else 0.0},
    }
