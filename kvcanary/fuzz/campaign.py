"""A fuzz campaign: N workloads, each run once unperturbed and K times under perturbed schedules.

Workload i of a campaign with seed S is the soak's workload of seed S + i; its perturbations have seeds
1..K (0 names the reference run). Every run is under the canary, with the planted bug, if any, in every run
(it is the engine's bug; the reference is the same engine on its usual schedule). A finding names its
workload seed and perturbation seed and replays alone: ``kvcanary fuzz --engine E --replay W:P``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TextIO

from kvcanary.fuzz.judge import Run, Verdict, judge
from kvcanary.soak.campaign import ProgressBar, check_bug, quiet_fast

ENGINES = ("sim", "transformers")


@dataclass
class WorkloadResult:
    """One workload's runs (the reference first) and their verdicts."""

    seed: int
    features: list[str]
    runs: list[Run]
    verdicts: list[Verdict]
    seconds: float


def _check_int(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"kv-canary: fuzz {name} must be an int >= {least}, got {value!r}")


def parse_replay(text: str) -> tuple[int, int]:
    """``"W:P"`` -> (workload seed, perturbation seed); ValueError for anything else."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"kv-canary: fuzz --replay must be WORKLOAD_SEED:PERTURBATION_SEED (e.g. 3:1), got {text!r}")
    return int(parts[0]), int(parts[1])


def replay_command(engine: str, seed: int, perturbation: int, bug: str | None) -> str:
    return f"kvcanary fuzz --engine {engine} --replay {seed}:{perturbation}" + (f" --bug {bug}" if bug else "")


def run_workload(engine: str, seed: int, perturbations: list[int], device: str = "cpu",
                 bug: str | None = None) -> WorkloadResult:
    """Run workload ``seed`` of ``engine`` unperturbed, then under each perturbation seed, and judge each run."""
    t0 = time.perf_counter()
    near_tie = None
    if engine == "sim":
        from kvcanary.fuzz.sim_fuzz import run_sim_schedule, sim_schedules
        from kvcanary.soak.sim_workload import make_sim_config

        features = make_sim_config(seed)[2]
        runs = [run_sim_schedule(seed, None, bug)]
        runs += [run_sim_schedule(seed, p, bug) for p in sim_schedules(seed, perturbations)]
    else:
        from kvcanary.fuzz import hf_fuzz
        from kvcanary.soak.hf_run import tiny_model

        w = hf_fuzz.fuzz_workload(seed)
        model = tiny_model(w.model, device)
        features = list(w.features)
        runs = [hf_fuzz.run_hf_schedule(model, w, None, device, bug)]
        perturbed = hf_fuzz.hf_schedules(seed, perturbations)
        runs += [hf_fuzz.run_hf_schedule(model, w, p, device, bug) for p in perturbed]
        near_tie = hf_fuzz.near_tie(model, w, runs[0])
    verdicts = [judge(runs[0], r, near_tie) for r in runs]
    if engine == "transformers":
        for p, r, v in zip(perturbed, runs[1:], verdicts[1:]):
            if r.error or set(r.failed) - set(runs[0].failed):
                # whose failure is it: the same schedule without the canary says
                alone = hf_fuzz.run_hf_schedule(model, w, p, device, bug, canary=False)
                alike = alone.error == r.error and set(alone.failed) == set(r.failed)
                v.findings.append("the engine fails alike without the canary" if alike
                                  else "the engine does not fail so without the canary")
    return WorkloadResult(seed, features, runs, verdicts, round(time.perf_counter() - t0, 3))


def run_fuzz(engine: str, workloads: int = 1, perturbations: int = 4, seed: int = 0, *, device: str = "cpu",
             bug: str | None = None, replay: tuple[int, int] | None = None, progress: TextIO | None = None) -> dict:
    """Fuzz ``workloads`` workloads from ``seed`` with ``perturbations`` schedules each; returns the summary.

    Args:
        engine: "sim" (the simulated engine) or "transformers" (tiny models on continuous batching).
        workloads: how many workloads (>= 1): seeds ``seed .. seed + workloads - 1``.
        perturbations: perturbed schedules per workload (>= 1): perturbation seeds 1..K.
        seed: the first workload's seed (>= 0).
        device: transformers only: "cpu" or "cuda".
        bug: plant this engine bug (``sim.bugs`` / ``sim.hf_bugs`` names) into every run.
        replay: (workload seed, perturbation seed): run that workload's reference and that one perturbation
            (0: the reference alone); ``workloads``, ``perturbations`` and ``seed`` are then ignored.
        progress: stream for the progress bar (None: silent).

    Example:
        >>> s = run_fuzz("sim", workloads=2, perturbations=3, seed=0)
        >>> s["ok"], s["runs"]
        (True, 8)
    """
    if engine not in ENGINES:
        raise ValueError(f"kv-canary: fuzz engine must be one of {list(ENGINES)}, got {engine!r}")
    check_bug(engine, bug, "fuzz")
    if replay is not None:
        if not (isinstance(replay, tuple) and len(replay) == 2):
            raise ValueError("kv-canary: fuzz replay must be a (workload seed, perturbation seed) tuple, got "
                             f"{replay!r}")
        _check_int("replay workload seed", replay[0], 0)
        _check_int("replay perturbation seed", replay[1], 0)
        seed, workloads = replay[0], 1
        schedule = [replay[1]] if replay[1] else []
    else:
        _check_int("workloads", workloads, 1)
        _check_int("perturbations", perturbations, 1)
        _check_int("seed", seed, 0)
        schedule = list(range(1, perturbations + 1))
    bar = ProgressBar(workloads, f"fuzz {engine}", progress)
    results: list[WorkloadResult] = []
    t0 = time.perf_counter()
    if engine == "transformers":
        from kvcanary.soak.hf_run import tiny_model

        for kind in ("llama", "hybrid"):  # built before the first workload's timer, and before the freeze
            tiny_model(kind, device)
    with quiet_fast():
        for i in range(workloads):
            results.append(run_workload(engine, seed + i, schedule, device, bug))
            bar.update(i + 1, sum(any(v.findings for v in r.verdicts) for r in results))
    bar.close()
    return summarize(engine, seed, len(schedule), results, time.perf_counter() - t0, bug=bug, device=device)


def summarize(engine: str, seed: int, perturbations: int, results: list[WorkloadResult], wall_s: float,
              bug: str | None = None, device: str = "cpu") -> dict:
    """The campaign's JSON summary: totals, what the schedules did, and each finding with what replays it."""
    pairs = [(w, r, v) for w in results for r, v in zip(w.runs, w.verdicts)]
    events: Counter = Counter()
    with_event: Counter = Counter()
    for _, r, _ in pairs:
        for k, n in r.events.items():
            events[k] += n
            with_event[k] += n > 0
    entry = lambda w, r: {"workload_seed": w.seed, "perturbation_seed": r.perturbation,  # noqa: E731
                          "replay": replay_command(engine, w.seed, r.perturbation, bug)}
    findings = [entry(w, r) | {"features": w.features, "schedule": r.params, "findings": v.findings,
                               "first_violations": r.first_violations} for w, r, v in pairs if v.findings]
    seconds = [w.seconds for w in results]
    return {
        "engine": engine, "device": device, "seed": seed, "workloads": len(results),
        "perturbations": perturbations, "planted_bug": bug, "ok": not findings, "runs": len(pairs),
        "violations": sum(r.violations for _, r, _ in pairs),
        "runs_with_violations": sum(r.violations > 0 for _, r, _ in pairs),
        "token_mismatches": sum(any(f.startswith("tokens:") for f in v.findings) for _, _, v in pairs),
        "errors": sum(any(f.startswith("error:") for f in v.findings) for _, _, v in pairs),
        # failures of a perturbed schedule that the engine has without the canary too: its own bugs
        "engine_own_failures": sum("the engine fails alike without the canary" in v.findings for _, _, v in pairs),
        "events": {k: {"total": events[k], "runs": with_event[k]} for k in sorted(events)},
        "findings": findings,
        "benign_divergences": [entry(w, r) | {"at": v.benign} for w, r, v in pairs if v.benign],
        "engine_failures": [entry(w, r) | {"error": v.engine_failure} for w, r, v in pairs if v.engine_failure],
        "wall_s": round(wall_s, 1),
        "seconds_per_workload": {"mean": round(sum(seconds) / max(1, len(seconds)), 3),
                                 "max": max(seconds, default=0.0)},
    }


def format_summary(s: dict) -> str:
    """The summary as text: totals, what the schedules did, then one line per finding."""
    lines = [f"kvcanary fuzz --engine {s['engine']}: {s['workloads']} workloads from seed {s['seed']} x "
             f"{s['perturbations']} perturbed schedules ({s['runs']} runs)"
             + (f", bug {s['planted_bug']} planted" if s["planted_bug"] else "") + f", {s['wall_s']} s",
             f"  violations {s['violations']} (in {s['runs_with_violations']} runs), token mismatches "
             f"{s['token_mismatches']}, errors {s['errors']} (failures alike without the canary "
             f"{s['engine_own_failures']}), benign near-tie divergences "
             f"{len(s['benign_divergences'])}, engine failures in the reference too {len(s['engine_failures'])}",
             "  events: " + ", ".join(f"{k} {v['total']} (in {v['runs']} runs)" for k, v in s["events"].items())]
    for f in s["findings"][:20]:
        lines.append(f"  FINDING workload {f['workload_seed']} perturbation {f['perturbation_seed']}: "
                     f"{'; '.join(f['findings'])}  (replay: {f['replay']})")
    if len(s["findings"]) > 20:
        lines.append(f"  ... {len(s['findings']) - 20} more findings (see the JSON)")
    for f in s["engine_failures"][:5]:
        lines.append(f"  engine failure workload {f['workload_seed']} perturbation {f['perturbation_seed']}: "
                     f"{f['error']}")
    lines.append("OK: no finding" if s["ok"] else f"FAILED: {len(s['findings'])} runs with findings")
    return "\n".join(lines)
