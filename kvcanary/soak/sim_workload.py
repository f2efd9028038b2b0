"""Seeded clean configurations of the simulated engine (kvcanary.sim), and one soak run of each.

A soak configuration draws every knob the zoo's matrix varies, in combinations the matrix does not hold:
page size 1..16, a sliding-window pool, speculative decoding with any acceptance rate, chunked prefill,
host offload, memory pressure (eviction, retraction), the sweep interval, the number of real-KV layers,
and the canary's CPU backend. Runs are shorter than the zoo's (fewer requests) so that each takes well
under a second once the backend is warm (numba; the torch path takes a few times longer). The sim has no
reference run: its token oracle makes every input known, so a clean run must report nothing and leave no
health problem.
"""

from __future__ import annotations

import importlib.util
import random
import time

from kvcanary.sim.bugs import BUGS
from kvcanary.sim.config import MATRIX, SimConfig
from kvcanary.soak.hf_run import Outcome

PAGE_SIZES = (1, 1, 2, 4, 8, 16)
SIM_EVENTS = ("retractions", "offloads", "loadbacks", "cache_hit_tokens", "aborted", "finished")


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


def make_sim_config(seed: int) -> tuple[SimConfig, str, list[str]]:
    """The sim configuration of ``seed``, the canary backend it runs with, and its features."""
    rng = random.Random(f"kvcanary-soak-sim-{seed}")
    # numba three times in four: its runs take a tenth of the torch path's once compiled
    backend = rng.choice(("torch", "numba", "numba", "numba"))
    if rng.random() < 0.25:
        # one of the zoo's matrix configurations with a fresh workload
        name = rng.choice(sorted(MATRIX))
        cfg = MATRIX[name].replace(seed=seed, num_requests=rng.randint(6, 12), name=f"soak-{name}")
        features = [f"matrix-{name}"]
    else:
        page = rng.choice(PAGE_SIZES)
        swa = rng.randint(4, 16) if rng.random() < 0.35 else 0
        offload = not swa and rng.random() < 0.35
        pressure = offload or rng.random() < 0.35  # (the prefix cache offloads what eviction pushes out)
        slots = _round_up(rng.randint(192, 320) if pressure else 1024, page)
        cfg = SimConfig(seed=seed, page_size=page, num_slots=slots, swa_window=swa,
                        spec_tokens=rng.randint(1, 3) if rng.random() < 0.35 else 0,
                        accept_prob=round(rng.uniform(0.1, 0.95), 2),
                        chunk_size=rng.choice((8, 12, 16, 24, 32)) if rng.random() < 0.4 else 0,
                        prefill_budget=rng.choice((48, 96, 128)), offload=offload,
                        host_slots=rng.choice((256, 512, 1024)), max_running=rng.randint(2, 8),
                        num_requests=rng.randint(6, 12), sweep_interval=rng.randint(1, 8),
                        num_layers=rng.randint(1, 3), name="soak")
        features = [f"page-size-{page}"]
        features += ["sliding-window"] if swa else []
        features += ["speculative"] if cfg.spec_tokens else []
        features += ["chunked-prefill"] if cfg.chunk_size else []
        features += ["offload"] if offload else []
        features += ["pressure"] if pressure else []
    if backend == "numba" and importlib.util.find_spec("numba") is None:
        backend = "torch"  # (the same workload; only the canary's CPU kernels differ)
    features.append(f"backend-{backend}")
    return cfg, backend, features


def run_sim_workload(seed: int, bug: str | None = None) -> Outcome:
    """Run the sim configuration of ``seed`` (``bug`` planted where it applies) and judge it."""
    from kvcanary.sim.engine import default_canary_config, run_sim

    cfg, backend, features = make_sim_config(seed)
    if bug is not None and BUGS[bug].applies(cfg):
        cfg = cfg.replace(bug=bug)
    t0 = time.perf_counter()
    result = Outcome(seed=seed, features=features)
    try:
        r = run_sim(cfg, default_canary_config(cfg).replace(backend=backend))
    except Exception as e:  # a configuration the engine cannot run is a finding, not a crash
        result.findings.append(f"error: {type(e).__name__}: {e}")
        result.seconds = round(time.perf_counter() - t0, 3)
        return result
    result.violations = r.violations
    result.events = {k: int(getattr(r, k)) for k in SIM_EVENTS}
    if r.violations:
        result.findings.append(f"violations: {r.violations} (first {r.first_report} at step "
                               f"{r.first_detected_step})")
        result.first_violations = [r.first_report or ""]
    if r.health_problems:
        result.findings.append(f"health: {'; '.join(r.health_problems[:3])}")
    result.note = cfg.features() + (f" bug={cfg.bug}" if cfg.bug else "")
    result.seconds = round(time.perf_counter() - t0, 3)
    return result
