"""Step-interleaved A/B: two engines on one model, one with the canary, stepping in turn.

Alternating whole generations (``engine.run_once``) leaves each pair of runs seconds apart, and a
shared host's speed drifts by more than the canary's cost over seconds (one 1B batch-1 workload
ranged from 42 to 85 tokens/s between rounds of one call). Here two continuous-batching managers
over the same model and the same prompts run side by side: engine A without the canary, engine B
with it, and their steps alternate (A B, then B A, ...), so each step of B is paired with the same
step of A a few milliseconds away. The pairs' ratio cancels the host's drift; its median over many
pairs is the end-to-end overhead.

Each step is timed from its ``prepare_next_batch`` to the end of its ``update_batch`` followed by a
device synchronize: the canary's side-stream work that would otherwise run beside the engine's host
work between steps is charged to its own step in full (a conservative count), and none of it runs
while the other engine's step is timed. Every step is split into its parts (batch preparation,
generation step with the forward and the canary's hooks, update) and the garbage collector's time
inside it, so where the canary's cost lands is visible. The two engines' steps must schedule the
same batches (same requests, same tokens); a step where they do not is reported, not paired.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

from kvcanary.bench.workload import generated, host_part

__all__ = ["run_lockstep", "summarize"]

PARTS = ("prepare", "step", "update", "gc")


def step_s(step: tuple) -> float:
    """A timed step's seconds: its prepare, step and update parts (the collector's time is inside them)."""
    return sum(step[3][:3])


def _gc_clock():
    """A callback for ``gc.callbacks`` and the seconds it has seen collections take."""
    total, start = [0.0], [0.0]

    def cb(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            total[0] += time.perf_counter() - start[0]

    return cb, total


def run_lockstep(model, wl, first_canary: bool = False, attach_canary: bool = True) -> dict:
    """One generation of the workload on two engines stepping in turn (``first_canary``: which engine
    takes the first step; the order alternates every step after it). ``attach_canary=False`` leaves
    engine B bare too: an A/A run, whose overhead is the method's own floor on that host.

    Returns per engine (False: without the canary, True: with it) the timed steps (``steps``: one
    ``(batch, tokens, measured, seconds by part)`` per step), outputs, the canary's host seconds per
    measured step (``parts``), violations found and the session's timing row of every step (``timings``)."""
    from transformers import GenerationConfig
    from kvcanary.integrations.transformers.reach import cb_config

    from kvcanary.integrations.transformers.reach import attach_with

    cuda = wl.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = GenerationConfig(max_new_tokens=wl.new_tokens, do_sample=False, eos_token_id=-1)
    managers, bps, handle, session = {}, {}, None, None
    cb, gc_s = _gc_clock()
    out = {c: {"steps": [], "outputs": {}} for c in (False, True)}
    parts, violations, timings = [], 0, []
    try:
        for c in (False, True):
            m = model.init_continuous_batching(gen, cb_config(**wl.cb))
            if c and attach_canary:
                handle = attach_with(m, config=wl.canary_config, mode="log", timing=True, **wl.attach_options)
            bps[c] = m.batch_processor = m._create_batch_processor()
            managers[c] = m
            for i, p in enumerate(wl.prompts):
                m.add_request(p, request_id=f"r{i}", max_new_tokens=wl.max_new_tokens(i))
        if handle is not None:
            session = handle.sessions[-1]
            session.canary.host_times = {"runtime_s": 0.0, "launch_s": 0.0}
        live, seen = {False: True, True: True}, {False: 0, True: 0}
        gc.callbacks.append(cb)
        sync()
        i = 0
        while live[False] or live[True]:
            order = (first_canary, not first_canary) if i % 2 == 0 else (not first_canary, first_canary)
            for c in order:
                if not live[c]:
                    continue
                bp, m = bps[c], managers[c]
                g0 = gc_s[0]
                t0 = time.perf_counter()
                if not bp.prepare_next_batch():
                    live[c] = False
                    continue
                io = bp.inputs_and_outputs
                batch, tokens = len(io.requests_in_batch), io.total_seqlen_q
                t1 = time.perf_counter()
                host = dict(session.canary.host_times) if c and session is not None else None
                m._generation_step()
                t2 = time.perf_counter()
                bp.update_batch()
                sync()
                t3 = time.perf_counter()
                measured = wl.measured(batch, tokens)
                take = measured and seen[c] >= wl.args.skip
                seen[c] += measured
                out[c]["steps"].append((batch, tokens, take, (t1 - t0, t2 - t1, t3 - t2, gc_s[0] - g0)))
                if host is not None and take:
                    parts.append(host_part(session, host))
            i += 1
        for c in (False, True):
            out[c]["outputs"] = generated(managers[c], bps[c])
        if handle is not None:
            handle.flush()
            violations = len(handle.violations)
            timings = list(session.timings)
    finally:
        if cb in gc.callbacks:
            gc.callbacks.remove(cb)
        if handle is not None:
            handle.detach()
        managers = bps = session = handle = None  # every reference to the engines before the cache is emptied
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {"without": out[False], "with": out[True], "parts": parts, "violations": violations,
            "timings": timings}


def median_interval(xs: list[float], z: float = 1.96) -> tuple[float, float] | None:
    """A distribution-free interval for the median of ``xs`` (about 95% at the default ``z``): the order
    statistics of ranks n/2 -+ z sqrt(n)/2, which assume only independent draws. None below six values."""
    n = len(xs)
    if n < 6:
        return None
    s, half = sorted(xs), z * math.sqrt(n) / 2
    lo, hi = max(1, math.floor(n / 2 - half)), min(n, math.ceil(1 + n / 2 + half))  # (1-based ranks)
    return s[lo - 1], s[hi - 1]


def summarize(rounds: list[dict]) -> dict:
    """Pair the rounds' steps (step i of B with step i of A, both measured and of the same batch).

    Returns the paired steps' seconds (``off``, ``on``), the median of the pairs' ratios less one
    (``paired_pct``), the median microseconds of each step part per engine, whole-generation tokens per
    second of each engine (tokens over the sum of all its steps), the median over rounds of the with-engine's
    extra milliseconds in the steps not measured (``unmeasured_extra_ms``), the collector's total milliseconds
    inside the paired steps per engine, the steps that did not pair, and an interval for the paired median
    (``paired_ci95_pct``, ``median_interval``)."""
    off, on, ratios, unpaired = [], [], [], 0
    by_part = {False: {k: [] for k in PARTS}, True: {k: [] for k in PARTS}}
    gen_tps = {False: [], True: []}
    once = []  # per round: the with-engine's extra seconds in the steps not measured (prefill, captures)
    for r in rounds:
        a, b = r["without"]["steps"], r["with"]["steps"]
        unpaired += abs(len(a) - len(b))
        extra = 0.0
        for sa, sb in zip(a, b):
            if sa[:2] != sb[:2]:
                unpaired += 1
                continue
            if not (sa[2] and sb[2]):
                extra += step_s(sb) - step_s(sa)
                continue
            ta, tb = step_s(sa), step_s(sb)
            off.append(ta)
            on.append(tb)
            ratios.append(tb / ta)
            for c, s in ((False, sa), (True, sb)):
                for k, v in zip(PARTS, s[3]):
                    by_part[c][k].append(v)
        for c, key in ((False, "without"), (True, "with")):
            steps = r[key]["steps"]
            tokens = sum(len(v) for v in r[key]["outputs"].values())
            total = sum(map(step_s, steps))
            if total:
                gen_tps[c].append(tokens / total)
        once.append(extra)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "off": off, "on": on, "unpaired": unpaired,
        # collections are rare (a median of 0): their total over the paired steps says more
        "gc_ms": {("with" if c else "without"): round(1e3 * sum(d["gc"]), 3) for c, d in by_part.items()},
        "paired_pct": 100 * (med(ratios) - 1) if ratios else None,
        # how far that median may be from the one more pairs would give (pairs of one host drift together, so
        # read it as a lower bound on the uncertainty: an A/A row shows the rest)
        "paired_ci95_pct": (None if (ci := median_interval(ratios)) is None
                            else [round(100 * (ci[0] - 1), 3), round(100 * (ci[1] - 1), 3)]),
        "parts_us": {("with" if c else "without"): {k: round(1e6 * med(v), 1) if v else None for k, v in d.items()}
                     for c, d in by_part.items()},
        "tokens_per_s": {("with" if c else "without"): med(v) for c, v in gen_tps.items()},
        # what a generation pays once (its prefill and the first decode steps, where graphs are captured):
        # the whole-generation tokens/s counts it, the paired overhead does not
        "unmeasured_extra_ms": round(1e3 * med(once), 3) if once else None,
    }
