"""A soak campaign: N seeded clean workloads on one engine, and what they found.

Workload i of a campaign with seed S is the workload of seed S + i, so a finding replays on its own
(``kvcanary soak --engine E --replay SEED``) and two campaigns with overlapping seeds share workloads.
Any violation, any greedy token that differs from the run without the canary, a failed request that
the run without the canary does not fail alike, an error or a health problem is a finding; a clean campaign
has none. Requests the engine fails alike in both runs are listed apart (``engine_failures``): the engine's
own limits or bugs, which the canary neither caused nor changed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TextIO

from kvcanary.soak.hf_run import Outcome

ENGINES = ("transformers", "sim", "vllm")


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"kv-canary: soak engine must be one of {list(ENGINES)}, got {engine!r}")


def check_bug(engine: str, bug: str | None, command: str = "soak") -> None:
    """ValueError unless ``bug`` names a planted bug of ``engine``'s registry (``command`` names the caller)."""
    if bug is None:
        return
    if engine == "transformers":
        from kvcanary.sim.hf_bugs import BUGS
    elif engine == "vllm":
        from kvcanary.sim.vllm_bugs import BUGS
    else:
        from kvcanary.sim.bugs import BUGS
    if bug not in BUGS:
        raise ValueError(f"kv-canary: {command} bug for engine {engine!r} must be one of {sorted(BUGS)}, got {bug!r}")


def describe(engine: str, seed: int) -> dict:
    """What workload ``seed`` of ``engine`` runs (no model, no run): for replays and reports."""
    check_engine(engine)
    if engine == "transformers":
        from kvcanary.soak.hf_run import installed_workload

        return installed_workload(seed).to_dict()
    if engine == "vllm":
        from kvcanary.soak.vllm_workload import make_vllm_workload

        return make_vllm_workload(seed).to_dict()
    from dataclasses import asdict

    from kvcanary.soak.sim_workload import make_sim_config

    cfg, backend, features = make_sim_config(seed)
    return {"seed": seed, "config": asdict(cfg), "backend": backend, "features": features}


def run_one(engine: str, seed: int, device: str = "cpu", bug: str | None = None) -> Outcome:
    """Run workload ``seed`` of ``engine`` once and judge it."""
    if engine == "transformers":
        from kvcanary.soak.hf_run import installed_workload, run_hf_workload

        return run_hf_workload(installed_workload(seed), device=device, bug=bug)
    if engine == "vllm":
        from kvcanary.soak.vllm_run import VllmSoak

        soak = VllmSoak()
        try:
            return soak.run(seed, bug=bug)
        finally:
            soak.close()
    from kvcanary.soak.sim_workload import run_sim_workload

    return run_sim_workload(seed, bug=bug)


@contextlib.contextmanager
def quiet_fast() -> Iterator[None]:
    """One torch thread, no per-violation log lines, and the objects that exist now frozen out of the
    garbage collector: transformers' batching calls ``gc.collect()`` twice per run, which otherwise walks
    every object of torch, transformers and numba each time (most of a tiny workload's wall time)."""
    import torch

    logger = logging.getLogger("kvcanary")
    level, threads = logger.level, torch.get_num_threads()
    logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        logger.setLevel(level)
        torch.set_num_threads(threads)


class ProgressBar:
    """A one-line progress bar redrawn with a carriage return (``stream`` None: silent)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = sys.stderr, width: int = 30):
        self.total, self.label, self.stream, self.width = total, label, stream, width
        self.t0 = time.perf_counter()

    def update(self, done: int, findings: int) -> None:
        if self.stream is None:
            return
        filled = self.width * done // max(1, self.total)
        rate = (time.perf_counter() - self.t0) / max(1, done)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
                          f"findings {findings}  {rate:.2f} s/workload")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


def run_campaign(engine: str, workloads: int, seed: int = 0, *, device: str = "cpu", bug: str | None = None,
                 progress: TextIO | None = None,
                 on_outcome: Callable[[Outcome], None] | None = None) -> dict:
    """Run workloads ``seed .. seed + workloads - 1`` of ``engine``; returns the summary (``summarize``).

    Args:
        engine: "transformers" (tiny models on continuous batching, each workload without and with the
            canary) or "sim" (the simulated engine's clean configurations).
        workloads: how many (>= 1).
        seed: the first workload's seed (>= 0).
        device: transformers only: "cpu" or "cuda".
        bug: plant this engine bug into every canary run (``sim.hf_bugs`` / ``sim.bugs`` names): a campaign
            that must find it.
        progress: stream for the progress bar (None: silent).
        on_outcome: called after each workload (e.g. to save partial results).
    """
    check_engine(engine)
    check_bug(engine, bug)
    if isinstance(workloads, bool) or not isinstance(workloads, int) or workloads < 1:
        raise ValueError(f"kv-canary: soak workloads must be an int >= 1, got {workloads!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"kv-canary: soak seed must be an int >= 0, got {seed!r}")
    bar = ProgressBar(workloads, f"soak {engine}", progress)
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    if engine == "transformers":
        from kvcanary.soak.hf_run import tiny_model

        for kind in ("llama", "hybrid"):  # built before the timer of the first workload, and before the freeze
            tiny_model(kind, device)
    if engine == "vllm":
        return _run_vllm_campaign(workloads, seed, bug, bar, outcomes, on_outcome, t0)
    with quiet_fast():
        for i in range(workloads):
            outcomes.append(run_one(engine, seed + i, device, bug))
            if on_outcome is not None:
                on_outcome(outcomes[-1])
            bar.update(i + 1, sum(bool(o.findings) for o in outcomes))
    bar.close()
    return summarize(engine, seed, outcomes, time.perf_counter() - t0, bug=bug, device=device)


def _run_vllm_campaign(workloads: int, seed: int, bug: str | None, bar: ProgressBar, outcomes: list[Outcome],
                       on_outcome: Callable[[Outcome], None] | None, t0: float) -> dict:
    """vLLM's campaign: engines kept across workloads (``soak.vllm_run``), started as workloads first need them."""
    from kvcanary.soak.vllm_run import VllmSoak

    logger = logging.getLogger("kvcanary")
    level = logger.level
    logger.setLevel(logging.ERROR)
    soak = VllmSoak()
    try:
        for i in range(workloads):
            outcomes.append(soak.run(seed + i, bug=bug))
            if on_outcome is not None:
                on_outcome(outcomes[-1])
            bar.update(i + 1, sum(bool(o.findings) for o in outcomes))
    finally:
        soak.close()
        logger.setLevel(level)
    bar.close()
    return summarize("vllm", seed, outcomes, time.perf_counter() - t0, bug=bug, device="cpu")


def summarize(engine: str, seed: int, outcomes: list[Outcome], wall_s: float, bug: str | None = None,
              device: str = "cpu") -> dict:
    """The campaign's JSON summary: coverage, totals, and each finding with what replays it."""
    features: Counter = Counter(f for o in outcomes for f in o.features)
    events: Counter = Counter()
    with_event: Counter = Counter()
    for o in outcomes:
        for k, v in o.events.items():
            events[k] += v
            with_event[k] += v > 0
    compared = [o for o in outcomes if o.tokens_compared]
    findings = [{"seed": o.seed, "features": o.features, "findings": o.findings,
                 "first_violations": o.first_violations,
                 "replay": f"kvcanary soak --engine {engine} --replay {o.seed}" + (f" --bug {bug}" if bug else "")}
                for o in outcomes if o.findings]
    engine_failures = [{"seed": o.seed, "features": o.features, "failed": o.engine_failures,
                        "replay": f"kvcanary soak --engine {engine} --replay {o.seed}"}
                       for o in outcomes if o.engine_failures and not o.findings]
    seconds = [o.seconds for o in outcomes]
    return {
        "engine": engine, "device": device, "seed": seed, "workloads": len(outcomes), "planted_bug": bug,
        "ok": not findings,
        "violations": sum(o.violations for o in outcomes),
        "workloads_with_violations": sum(o.violations > 0 for o in outcomes),
        "greedy_workloads_compared": len(compared),
        "token_mismatches": sum(o.tokens_match is False for o in compared),
        "errors": sum(any(f.startswith("error") for f in o.findings) for o in outcomes),
        "features": dict(sorted(features.items())),
        "events": {k: {"total": events[k], "workloads": with_event[k]} for k in sorted(events)},
        "findings": findings,
        "engine_failures": engine_failures,
        "wall_s": round(wall_s, 1),
        "seconds_per_workload": {"mean": round(sum(seconds) / max(1, len(seconds)), 3),
                                 "max": max(seconds, default=0.0)},
    }


def format_summary(s: dict) -> str:
    """The summary as text: totals, coverage, then one line per finding."""
    totals = f"  violations {s['violations']} (in {s['workloads_with_violations']} workloads), errors {s['errors']}"
    if s["engine"] in ("transformers", "vllm"):
        totals += (f", token mismatches {s['token_mismatches']} of {s['greedy_workloads_compared']} greedy "
                   f"workloads, engine failures alike without the canary {len(s['engine_failures'])}")
    lines = [f"kvcanary soak --engine {s['engine']}: {s['workloads']} workloads from seed {s['seed']}"
             + (f", bug {s['planted_bug']} planted" if s["planted_bug"] else "") + f", {s['wall_s']} s", totals,
             "  features: " + ", ".join(f"{k} {v}" for k, v in s["features"].items()),
             "  events: " + ", ".join(f"{k} {v['total']} (in {v['workloads']})" for k, v in s["events"].items())]
    for f in s["findings"][:20]:
        lines.append(f"  FINDING seed {f['seed']} [{' '.join(f['features'])}]: {'; '.join(f['findings'])}"
                     f"  (replay: {f['replay']})")
    for f in s["engine_failures"][:10]:
        lines.append(f"  engine failure (alike without the canary) seed {f['seed']}: {len(f['failed'])} failed "
                     f"requests ({f['failed'][0]})")
    if len(s["findings"]) > 20:
        lines.append(f"  ... {len(s['findings']) - 20} more findings (see the JSON)")
    lines.append("OK: no finding" if s["ok"] else f"FAILED: {len(s['findings'])} workloads with findings")
    return "\n".join(lines)
