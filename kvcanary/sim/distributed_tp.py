"""Tensor parallelism on the simulated engine: one engine, one canary per rank, a consistency step.

Every rank runs the same seeded ``SimEngine`` (the same scheduler decisions, as TP
ranks take them), but its mock model holds the rank's own shard of the heads
(``MockModel.shard``), so its real-KV hashes are its own. After every forward the
rank's ``ConsistencyCheck`` counts a step; every ``interval`` forwards the ranks
exchange their counters and digests and name whoever diverged.

Planted bugs (on one rank, the victim):
- ``tp_divergent_allocator``: once, the victim's page allocator hands out the next free
  page instead of the lowest: its records land in other slots than everyone else's.
- ``tp_skipped_copy``: the victim skips the KV move of accepted speculative tokens (and the
  records with it), as a rank whose copy kernel was not launched.
"""

from __future__ import annotations

import torch.distributed as dist

from kvcanary.distributed import ConsistencyCheck, gather_violations
from kvcanary.sim.config import SimConfig
from kvcanary.sim.engine import SimEngine

# Forward step from which the divergent allocator may strike (the pool has churned by then).
DIVERGE_FROM_STEP = 6


def victim_rank(world: int) -> int:
    """The rank a TP bug is planted on: the last of two (rank 0 is the tie's reference), the second of more."""
    return world - 1 if world == 2 else 1


def _plant_divergent_allocator(engine: SimEngine, planted: dict) -> None:
    pages = engine.pool.pages
    alloc = pages.alloc

    def divergent_alloc(num_pages: int):
        if planted["step"] is not None or engine.canary.step < DIVERGE_FROM_STEP or not num_pages:
            return alloc(num_pages)
        got = alloc(num_pages + 1)
        if got is None:
            return alloc(num_pages)
        # Planted: this rank skips the lowest free page once; the other ranks take it.
        pages.free(got[:1])
        planted["step"] = engine.canary.step + 1
        return got[1:]

    pages.alloc = divergent_alloc


def run_tp(rank: int, world: int, cfg: SimConfig, bug: str | None, interval: int, device=None,
           group=None) -> dict | None:
    """One TP scenario on this rank (collective over ``group``); rank 0 returns the scenario's result.

    ``device``: where the exchanged vectors travel (the rank's GPU with NCCL; the sim's canary stays on CPU).
    """
    victim = victim_rank(world)
    here = bug if rank == victim else None
    engine = SimEngine(cfg.replace(bug="spec_not_moved") if here == "tp_skipped_copy" else cfg)
    engine.model.shard = rank
    planted = {"step": None}
    if here == "tp_divergent_allocator":
        _plant_divergent_allocator(engine, planted)
    check = ConsistencyCheck(engine.canary, interval=interval, group=group, device=device)
    while engine.step_no < cfg.max_steps:
        before = engine.canary.step
        engine.step()
        if engine.canary.step != before:
            check.step()
        if not engine.sched.busy and engine.step_no > engine.workload.last_arrival:
            break
    check.finish()
    if here == "tp_skipped_copy":
        planted["step"] = engine.bugs.first_step
    rows = gather_violations(engine.canary.violations, "tp", group=group)
    info = {"rank": rank, "planted_step": planted["step"], "violations": engine.canary.monitor.total_violations,
            "steps": engine.canary.step, "cost": check.cost(), "tokens": engine.canary.stats()["tokens_protected"]}
    infos = [None] * world if rank == 0 else None
    dist.gather_object(info, infos, dst=0, group=group)
    if rank != 0:
        return None
    planted_step = next((i["planted_step"] for i in infos if i["planted_step"] is not None), None)
    divs = check.divergences
    return {
        "kind": "tp", "bug": bug, "config": cfg.name, "world": world, "victim": victim if bug else None,
        "planted_step": planted_step,
        "first_detected_step": min((d.step for d in divs), default=None),
        "named": sorted({d.rank for d in divs}),
        "divergences": [d.to_dict() for d in divs],
        "violations": sum(i["violations"] for i in infos),
        "rows": [r.log_line() for r in rows[:20]],
        "violation_rows": [r.to_dict() for r in rows[:20]],
        "violations_by_rank": {i["rank"]: i["violations"] for i in infos},
        "steps": infos[0]["steps"], "tokens": infos[0]["tokens"],
        "consistency": [i["cost"] for i in infos],
    }
