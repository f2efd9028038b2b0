"""Run vLLM soak workloads without and with the canary, on engines kept for the whole campaign.

Per engine set-up (``vllm_workload.ENGINES``) the campaign starts two engines of the same settings: one
without the canary (started while its vLLM plugin is not installed, so its model runner has no session) and
one with it. Each workload's requests go through both, in the same order, so both engines' prefix caches and
schedules stay alike: the canary must report nothing and the greedy tokens must be equal. A planted bug
(``sim.vllm_bugs``, tensor parallelism 1) goes into the canary's engine only, for the workload.
"""

from __future__ import annotations

import contextlib
import os
import time

from kvcanary.soak.hf_run import Outcome
from kvcanary.soak.vllm_workload import ENGINES, make_vllm_workload

EVENTS = ("prefix_hits", "prefix_hit_tokens", "preemptions", "chunked_steps")  # (+ guarded_forwards)
# the canary's own counts on its engine: forwards checked in waves, sources the write check compared
CANARY_EVENTS = ("split_forwards", "write_check_notes")


class VllmSoak:
    """The engines of one campaign (``close`` shuts them down and removes the canary's hooks)."""

    def __init__(self, model_dir: str | None = None):
        from kvcanary.sim.vllm_drive import tiny_model_dir

        from kvcanary.integrations.vllm import engine

        self.model_dir = model_dir or tiny_model_dir()
        self.engines: dict[str, tuple] = {}
        self.events: dict[str, dict] = {}
        self._env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
        # the canary's hooks stay in for the campaign: the canary's engines run through them
        self._hooks = contextlib.ExitStack()
        self._hooks.enter_context(engine.guarded(True, KV_CANARY_MODE="log"))

    def _pair(self, name: str):
        if name in self.engines:
            return self.engines[name]
        from kvcanary.integrations.vllm import engine
        from kvcanary.sim.vllm_drive import make_llm
        from kvcanary.sim.vllm_tp import tp_environment

        settings = ENGINES[name]
        if settings.get("tensor_parallel_size", 1) > 1:
            os.environ.update(tp_environment())
        # without the canary: no hooks while it starts, so its runner has no session (KV_CANARY_VLLM=0 reaches
        # its workers too)
        with engine.guarded(False):
            base = make_llm(self.model_dir, **settings)
        self.events[name] = _count_events(base)
        canary = make_llm(self.model_dir, **settings)
        self.engines[name] = (base, canary)
        return base, canary

    def run(self, seed: int, bug: str | None = None) -> Outcome:
        """Workload ``seed`` through its set-up's two engines, judged."""
        from kvcanary.sim.vllm_drive import Arrival, drive

        t0 = time.perf_counter()
        w = make_vllm_workload(seed)
        out = Outcome(seed=seed, features=list(w.features))
        arrivals = [Arrival(f"s{seed}-{i}", p, m, step=s)
                    for i, (p, m, s) in enumerate(zip(w.prompts, w.max_tokens, w.steps))]
        try:
            base, canary = self._pair(w.engine)
            before_events = dict(self.events[w.engine])
            want = drive(base, arrivals)
            out.events = {k: self.events[w.engine][k] - before_events[k] for k in EVENTS}
            before = _snapshot(canary)
            with _planted(bug, canary, w.engine):
                got = drive(canary, arrivals)
            after = _snapshot(canary)
        except Exception as e:  # a workload the engine or the canary cannot run is a finding, not a crash
            out.findings.append(f"error: {type(e).__name__}: {e}")
            out.seconds = round(time.perf_counter() - t0, 3)
            return out
        rows = after["rows"][len(before["rows"]):]
        out.violations = after["violations"] - before["violations"]
        out.first_violations = [r.get("log_line", str(r)) if isinstance(r, dict) else str(r) for r in rows[:3]]
        out.events["guarded_forwards"] = after["forwards"] - before["forwards"]
        out.events.update({k: after[k] - before[k] for k in CANARY_EVENTS})
        if out.violations:
            out.findings.append(f"violations: {out.violations}")
        if after["divergences"] > before["divergences"]:
            out.findings.append(f"tensor-parallel divergences: {after['divergences'] - before['divergences']}")
        tp = ENGINES[w.engine].get("tensor_parallel_size", 1)
        if after["guarded_ranks"] != tp or not out.events["guarded_forwards"]:
            out.findings.append(f"unguarded: {after['guarded_ranks']} of {tp} ranks guarded, "
                                f"{out.events['guarded_forwards']} forwards guarded")
        out.tokens_compared, out.tokens_match = True, got == want
        if got != want:
            diff = sum(got.get(r) != t for r, t in want.items()) + len(set(got) - set(want))
            out.findings.append(f"tokens: {diff} of {len(want)} requests differ from the run without the canary")
        out.note = f"engine {w.engine}"
        out.seconds = round(time.perf_counter() - t0, 3)
        return out

    def close(self) -> None:
        from kvcanary.integrations.vllm import engine

        for base, canary in self.engines.values():
            for llm in (base, canary):
                engine.stop(llm)
        self.engines.clear()
        self._hooks.close()
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _snapshot(llm) -> dict:
    """The canary's totals so far on ``llm`` (every rank): violations (rows kept and counted), TP divergences,
    forwards guarded, ranks with a canary session."""
    from kvcanary.integrations.vllm import collect

    r = collect(llm)
    return {"rows": list(r.violations), "violations": max(r.total_violations, len(r.violations)),
            "divergences": len(r.divergences), "forwards": r.forwards,
            "guarded_ranks": sum(bool(s.get("guarded")) for s in r.stats),
            **{k: sum(int(s.get(k, 0)) for s in r.stats) for k in CANARY_EVENTS}}


@contextlib.contextmanager
def _planted(bug: str | None, llm, engine: str):
    if bug is None or ENGINES[engine].get("tensor_parallel_size", 1) > 1:
        yield None
        return
    from kvcanary.sim.vllm_bugs import plant

    with plant(bug, llm) as state:
        yield state


def _count_events(llm) -> dict:
    """Count what the engine did (on the engine without the canary, which schedules alike): prefix-cache hits,
    preemptions, steps with a chunked prefill. Instance wrappers on its scheduler, kept for the campaign."""
    from kvcanary.sim.vllm_drive import engine_core

    sched = engine_core(llm).scheduler
    counts = dict.fromkeys(EVENTS, 0)
    kvm, preempt, after = sched.kv_cache_manager, sched._preempt_request, sched._update_after_schedule
    computed = kvm.get_computed_blocks

    def get_computed_blocks(request):
        out = computed(request)
        hit = out[1] if isinstance(out, tuple) and len(out) > 1 else 0
        counts["prefix_hits"] += hit > 0
        counts["prefix_hit_tokens"] += hit
        return out

    def _preempt_request(*args, **kwargs):
        counts["preemptions"] += 1
        return preempt(*args, **kwargs)

    def _update_after_schedule(so):
        after(so)
        counts["chunked_steps"] += any(sched.requests[r].is_prefill_chunk for r in so.num_scheduled_tokens
                                       if r in sched.requests)

    kvm.get_computed_blocks, sched._preempt_request = get_computed_blocks, _preempt_request
    sched._update_after_schedule = _update_after_schedule
    return counts
