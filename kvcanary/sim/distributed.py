"""The distributed zoo: tensor-parallel and prefill/decode runs of the simulated engine in N processes.

``run_distributed(world_size, backend)`` spawns one process group (gloo on CPU, NCCL
with one GPU per rank) and plays every scenario in it: clean TP and PD runs, then each
planted distributed bug (``DIST_BUGS``). A TP bug counts as detected when the
consistency step names exactly the rank it was planted on; a PD bug when the decode
instance's arrival check or its canary reports it, never before the bug took effect.
Clean runs must report nothing on any rank. Costs are measured in the same runs:
seconds per consistency exchange (and per forward at the interval), seconds per
arrived request for packing and sending, landing, and the arrival check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvcanary.distributed import DEFAULT_INTERVAL, spawn
from kvcanary.sim.config import SimConfig
from kvcanary.sim.distributed_bench import bench_costs
from kvcanary.sim.distributed_pd import run_pd
from kvcanary.sim.distributed_tp import run_tp
from kvcanary.sim.zoo import quiet_and_single_threaded


@dataclass(frozen=True)
class DistBug:
    """A planted distributed bug: ``kind`` "tp" (one rank of a TP group) or "pd" (the decode side's receive)."""

    name: str
    kind: str
    cls: str
    summary: str
    expect: str


DIST_BUGS: dict[str, DistBug] = {b.name: b for b in (
    DistBug("tp_divergent_allocator", "tp", "A", "one rank's allocator hands out a different page once",
            "consistency step: records:full differs on that rank only; the rank is named"),
    DistBug("tp_skipped_copy", "tp", "I", "one rank skips the KV move of accepted speculative tokens",
            "that rank's canary reports chain/position/token; the consistency step names it"),
    DistBug("pd_page_order", "pd", "G", "the transfer delivers the first two pages in swapped order",
            "arrival check: verify_real_kv_hash on both pages"),
    DistBug("pd_wrong_slots", "pd", "D", "the KV lands at the prefill side's slot numbers",
            "arrival check: verify_real_kv_hash on every slot; later TAIL checks where it overwrote"),
    DistBug("pd_partial", "pd", "G", "the last page never arrives and the transfer counts as complete",
            "arrival check: verify_real_kv_hash on the last page"),
    DistBug("pd_table_other", "pd", "C", "the decode table row points at another arrival's slots",
            "arrival check: chain, position or token at the borrowed slots"),
    DistBug("pd_read_early", "pd", "B", "the request is read before its KV copy completed",
            "arrival check (and the first decode forward): verify_real_kv_hash"),
)}

# The runs' engines: small workloads (two engines per scenario, several scenarios per process).
CONFIGS = {
    "tp": SimConfig(name="tp", num_requests=10, max_output=12),
    "tp-spec-paged": SimConfig(name="tp-spec-paged", page_size=4, spec_tokens=3, num_requests=10, max_output=12),
    "pd-paged": SimConfig(name="pd-paged", page_size=4, num_requests=10, max_output=12),
}
_BUG_CONFIG = {"tp_divergent_allocator": "tp", "tp_skipped_copy": "tp-spec-paged"}


def plan_scenarios(bugs: list[str] | None = None, clean: bool = True) -> list[tuple[str, str | None, str]]:
    """(kind, bug or None, config name) of every run: clean TP and PD runs first, then each bug."""
    names = list(DIST_BUGS) if bugs is None else bugs
    for b in names:
        if b not in DIST_BUGS:
            raise ValueError(f"kv-canary: distributed bug must be one of {sorted(DIST_BUGS)}, got {b!r}")
    out = [("tp", None, "tp"), ("tp", None, "tp-spec-paged"), ("pd", None, "pd-paged")] if clean else []
    return out + [(DIST_BUGS[b].kind, b, _BUG_CONFIG.get(b, "pd-paged")) for b in names]


def rank_main(ctx, scenarios, interval: int, bench_slots: int, bench_tokens: int, overrides: dict) -> dict | None:
    """Every scenario on this rank (spawned by ``run_distributed``); rank 0 returns the report's data."""
    results = []
    with quiet_and_single_threaded():
        for kind, bug, name in scenarios:
            t0 = time.perf_counter()
            cfg = CONFIGS[name].replace(**overrides)
            if kind == "tp":
                r = run_tp(ctx.rank, ctx.world_size, cfg, bug, interval, ctx.device)
            else:
                r = run_pd(ctx.rank, ctx.world_size, cfg, bug, ctx.device)
            if r is not None:
                r["wall_s"] = round(time.perf_counter() - t0, 3)
                results.append(r)
        bench = bench_costs(ctx, bench_slots, bench_tokens) if bench_slots else None
    if ctx.rank != 0:
        return None
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    return {"results": results, "bench": bench, "device": device}


def verdict(r: dict) -> str:
    """'clean' / 'FALSE ALARM' for clean runs; 'detected' / 'MISSED' / 'WRONG RANK' / 'EARLY' / 'NOT PLANTED'."""
    found = r["violations"] + r.get("arrival_violations", 0) + len(r.get("divergences", []))
    if r["bug"] is None:
        return "clean" if not found else "FALSE ALARM"
    if r["planted_step"] is None:
        return "NOT PLANTED"
    if r["kind"] == "tp" and r["named"] != [r["victim"]]:
        return "MISSED" if not r["named"] else "WRONG RANK"
    if not found:
        return "MISSED"
    first = r["first_detected_step"]
    if first is not None and first < r["planted_step"]:
        return "EARLY"
    return "detected"


@dataclass
class DistReport:
    backend: str
    world_size: int
    interval: int
    device: str = "cpu"
    results: list[dict] = field(default_factory=list)
    bench: dict | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(verdict(r) == ("clean" if r["bug"] is None else "detected") for r in self.results)

    def costs(self) -> dict:
        """Mean consistency cost over every TP run and rank, and per-request transfer costs over PD runs."""
        cons = [c for r in self.results if r["kind"] == "tp" for c in r["consistency"] if c["exchanges"]]
        pd = [r["cost"] for r in self.results if r["kind"] == "pd" and r["transfers"]]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {"consistency_exchange_s": mean([c["mean_exchange_s"] for c in cons]),
                "consistency_local_s": mean([c["mean_local_s"] for c in cons]),
                "consistency_per_step_s": mean([c["per_step_s"] for c in cons]),
                "transfer_send_s": mean([c["send_s_per_request"] for c in pd]),
                "transfer_land_s": mean([c["land_s_per_request"] for c in pd]),
                "transfer_check_s": mean([c["check_s_per_request"] for c in pd])}

    def to_dict(self) -> dict:
        return {"ok": self.ok, "backend": self.backend, "world_size": self.world_size, "interval": self.interval,
                "device": self.device, "wall_s": round(self.wall_s, 2), "costs": self.costs(), "bench": self.bench,
                "results": [{**r, "verdict": verdict(r)} for r in self.results]}


def run_distributed(world_size: int = 2, backend: str = "gloo", bugs: list[str] | None = None,
                    interval: int = DEFAULT_INTERVAL, bench_slots: int = 0, bench_tokens: int = 4096,
                    timeout_s: float = 300.0, clean: bool = True, **overrides) -> DistReport:
    """Spawn ``world_size`` ranks and run the distributed scenarios (see the module docstring).

    Args:
        world_size: processes (>= 2; PD uses rank pairs (0, 1), (2, 3), ...).
        backend: "gloo" (CPU) or "nccl" (one GPU per rank).
        bugs: planted bugs to run (default all of ``DIST_BUGS``).
        interval: forwards between consistency exchanges.
        bench_slots: > 0 also times one exchange over a canary of that many slots and the arrival
            check of a ``bench_tokens``-token request on each rank's device (``distributed_bench``).
        timeout_s: deadline for the whole run.
        clean: also run the clean baselines.
        overrides: ``SimConfig`` fields applied to every run's engine (e.g. a smaller ``num_requests``).
    """
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(f"kv-canary: interval must be an int >= 1, got {interval!r}")
    scenarios = plan_scenarios(bugs, clean)
    t0 = time.perf_counter()
    CONFIGS["tp"].replace(**overrides)  # a bad override fails here, not in every rank
    out = spawn(rank_main, world_size, scenarios, interval, bench_slots, bench_tokens, overrides, backend=backend,
                timeout_s=timeout_s)
    report = DistReport(backend, world_size, interval, out["device"], out["results"], out["bench"])
    report.wall_s = time.perf_counter() - t0
    return report


def format_report(report: DistReport) -> str:
    """One row per run, then the measured costs and the verdict."""
    head = ("kind", "bug", "config", "result", "planted", "detected", "named", "violations", "arrival", "divergent")
    rows = []
    for r in report.results:
        named = ",".join(f"rank {x}" for x in r["named"]) or "-"
        rows.append((r["kind"], r["bug"] or "(clean)", r["config"], verdict(r), _s(r["planted_step"]),
                     _s(r["first_detected_step"]), named, str(r["violations"]), str(r.get("arrival_violations", "-")),
                     ";".join(",".join(d["fields"][:2]) for d in r.get("divergences", [])[:2]) or "-"))
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in widths])] + [line(x) for x in rows] + [""]
    c = report.costs()
    out.append(f"consistency step ({report.backend}, {report.world_size} ranks, {report.device}): "
               f"{c['consistency_exchange_s'] * 1e6:.0f} us per exchange "
               f"({c['consistency_local_s'] * 1e6:.0f} us of it "
               f"local, the rest all_gather and waiting for the slowest rank), every {report.interval} forwards = "
               f"{c['consistency_per_step_s'] * 1e6:.1f} us per step (sim canary, 1024 slots)")
    out.append(f"transfer per request (sim, ~40 tokens): land {c['transfer_land_s'] * 1e6:.0f} us, arrival check "
               f"{c['transfer_check_s'] * 1e6:.0f} us (pack+send {c['transfer_send_s'] * 1e6:.0f} us, waiting for the "
               "peer included)")
    if report.bench:
        b = report.bench
        out.append(f"bench on {report.device}: consistency exchange over {b['slots']} slots "
                   f"{b['exchange_s'] * 1e6:.0f} us (= {b['exchange_s'] / report.interval * 1e6:.1f} us per step at "
                   f"interval {report.interval}); arrival check of a {b['tokens']}-token request "
                   f"{b['check_s'] * 1e6:.0f} us; pack+send+recv+land {b['transfer_s'] * 1e6:.0f} us")
    out.append(("OK" if report.ok else "FAILED") + f": {len(report.results)} runs, {report.wall_s:.1f} s")
    return "\n".join(out)


def _s(x) -> str:
    return "-" if x is None else str(x)
