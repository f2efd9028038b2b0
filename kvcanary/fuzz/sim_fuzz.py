"""Perturbed schedules of the simulated engine: what a perturbation seed changes, and one run under it.

The workload of seed W is the soak's (``soak.sim_workload.make_sim_config(W)``): engine layout, features and
requests. A perturbation changes only how the engine schedules that workload, never what it computes:

  prefill_budget, chunk_size   the token budget per forward (chunked prefill on, off, another chunk size)
  max_running                  the batch cap: requests prefilling or decoding at once (1 = one at a time)
  num_slots                    the pool: a tighter one forces prefix-cache eviction, offload and retraction
  preempt_steps                steps at which the newest decoding request is retracted (forced preemption)
  arrivals                     requests moved to other arrival steps (shuffled, shifted, or all at once);
                               an abort keeps its distance from its request's arrival

The page size, speculative decoding, the sliding window and the workload's lengths stay, so every run feeds
the same requests and the token oracle gives each the same tokens. Every run, the reference included, runs
a generous ``max_steps`` so that a slow schedule finishes; a request left unfinished is a failure.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass

from kvcanary.fuzz.judge import Run
from kvcanary.sim.bugs import BUGS
from kvcanary.sim.config import SimConfig
from kvcanary.sim.request import State
from kvcanary.sim.workload import Workload
from kvcanary.soak.sim_workload import SIM_EVENTS, make_sim_config

MAX_STEPS = 1500  # (one request at a time, 12 requests of up to 32 outputs: well under 600 steps)


@dataclass(frozen=True)
class SimPerturbation:
    """One drawn schedule for a sim workload (see the module docstring); ``seed`` >= 1 names it."""

    seed: int
    prefill_budget: int
    chunk_size: int
    max_running: int
    num_slots: int
    preempt_steps: tuple[int, ...]
    arrivals: tuple[tuple[int, int], ...]  # (request id, its new arrival step), for the requests that move
    arrival_mode: str  # "kept", "shifted", "shuffled" or "burst"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["preempt_steps"] = list(self.preempt_steps)
        d["arrivals"] = dict(self.arrivals)
        return d


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


def draw_sim_perturbation(cfg: SimConfig, workload: Workload, seed: int) -> SimPerturbation:
    """Perturbation ``seed`` (>= 1) of the workload of ``cfg`` (every draw comes from the two seeds)."""
    rng = random.Random(f"kvcanary-fuzz-sim-{cfg.seed}-{seed}")
    budget = rng.choice((cfg.prefill_budget, 16, 32, 48, 96, 128))
    chunk = rng.choice((cfg.chunk_size, 0, 0, 8, 12, 16, 24, 32))
    running = rng.choice((cfg.max_running, 1, 2, 3, 4, 6, max(cfg.graph_sizes)))
    ps = cfg.page_size
    # a tight pool evicts and retracts; 192 slots still hold the longest request (max_context 160) and a page
    slots = rng.choice((cfg.num_slots, _round_up(rng.randint(192, 320), ps), _round_up(1024, ps)))
    preempt = tuple(sorted(rng.sample(range(2, 80), rng.randint(1, 4)))) if rng.random() < 0.5 else ()
    specs = workload.specs
    mode = rng.choice(("kept", "shifted", "shifted", "shuffled", "burst"))
    if mode == "shuffled":
        steps = [s.arrival for s in specs]
        rng.shuffle(steps)
    elif mode == "shifted":
        steps = [max(1, s.arrival + rng.randint(-4, 8)) if rng.random() < 0.5 else s.arrival for s in specs]
    elif mode == "burst":
        steps = [1] * len(specs)
    else:
        steps = [s.arrival for s in specs]
    moved = tuple((s.rid, a) for s, a in zip(specs, steps) if a != s.arrival)
    return SimPerturbation(seed=seed, prefill_budget=budget, chunk_size=chunk, max_running=running, num_slots=slots,
                           preempt_steps=preempt, arrivals=moved, arrival_mode=mode)


def _moved_workload(workload: Workload, arrivals: dict[int, int]) -> Workload:
    specs = []
    for s in workload.specs:
        a = arrivals.get(s.rid, s.arrival)
        abort = None if s.abort_at is None else s.abort_at + a - s.arrival
        specs.append(dataclasses.replace(s, arrival=a, abort_at=abort))
    return Workload(specs, workload.vocab)


def _force_preemptions(engine, steps: tuple[int, ...]) -> list[int]:
    """Retract the newest decoding request before decode is scheduled at each of ``steps`` (per instance);
    returns the list that counts the preemptions that happened."""
    sched, done = engine.sched, []
    orig = sched.schedule_decode

    def schedule_decode():
        if engine.step_no in steps and sched.preempt():
            done.append(engine.step_no)
        return orig()

    sched.schedule_decode = schedule_decode
    return done


def run_sim_schedule(seed: int, perturbation: SimPerturbation | None, bug: str | None = None) -> Run:
    """Run the sim workload of ``seed`` under ``perturbation`` (None: the reference schedule), under the canary,
    with ``bug`` planted where the run's configuration lets it apply."""
    from kvcanary.sim.engine import SimEngine, default_canary_config

    cfg, backend, _ = make_sim_config(seed)
    p = perturbation
    cfg = cfg.replace(max_steps=MAX_STEPS)
    if p is not None:
        cfg = cfg.replace(prefill_budget=p.prefill_budget, chunk_size=p.chunk_size, max_running=p.max_running,
                          num_slots=p.num_slots)
    if bug is not None and BUGS[bug].applies(cfg):
        cfg = cfg.replace(bug=bug)
    run = Run(perturbation=0 if p is None else p.seed, params={"backend": backend, "config": cfg.features()}
              | ({} if p is None else p.to_dict()))
    t0 = time.perf_counter()
    try:
        engine = SimEngine(cfg, default_canary_config(cfg).replace(backend=backend))
        preempted: list[int] = []
        if p is not None:
            engine.workload = _moved_workload(engine.workload, dict(p.arrivals))
            preempted = _force_preemptions(engine, p.preempt_steps)
        r = engine.run()
    except Exception as e:  # a schedule the engine cannot run is judged against the reference, not a crash
        run.error = f"{type(e).__name__}: {e}"
        run.seconds = round(time.perf_counter() - t0, 3)
        return run
    run.violations = r.violations
    run.first_violations = [v.log_line() for v in engine.canary.violations[:3]]
    if r.refused:
        run.problems.append(f"refused forward: {r.refused}")
    run.problems += [f"health: {h}" for h in r.health_problems[:3]]
    run.events = {k: int(getattr(r, k)) for k in SIM_EVENTS} | {"forced_preemptions": len(preempted)}
    for s in engine.workload.specs:
        req = engine.sched.requests.get(s.rid)
        if req is not None and req.state is State.FINISHED:
            # (a verify may commit drafts past max_new; the tokens asked for are what the client sees)
            run.tokens[str(s.rid)] = req.tokens[:len(req.prompt) + req.max_new]
        elif req is not None and req.state is State.ABORTED:
            run.aborted.append(str(s.rid))
        elif not r.refused:  # (a refused forward ends the run: what it left unfinished says nothing more)
            state = "never arrived" if req is None else req.state.value
            run.failed[str(s.rid)] = f"unfinished ({state}) after {engine.step_no} steps"
    run.seconds = round(time.perf_counter() - t0, 3)
    return run


def sim_schedules(seed: int, perturbations: list[int]) -> list[SimPerturbation]:
    """The perturbations of workload ``seed`` named by ``perturbations`` (seeds >= 1)."""
    from kvcanary.sim.workload import make_workload

    cfg = make_sim_config(seed)[0]
    workload = make_workload(cfg)
    return [draw_sim_perturbation(cfg, workload, p) for p in perturbations]
