"""Planted vLLM bugs and the shadow oracle on every tensor-parallel rank.

Under tensor parallelism vLLM runs each rank's model runner in a worker process of its multiprocess
executor; the bug and the oracle go in there through ``LLM.collective_rpc`` (the functions below travel by
reference, so the workers import this module), one install call before the workload and one collect call
after it. Each rank judges its own shard of the KV; the verdict adds the ranks' wrong reads.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time

_LIVE: dict = {}  # per worker process: the bug's context manager, its state, the oracle


def _runner(worker):
    w = getattr(worker, "worker", worker)
    return w.model_runner, int(getattr(w, "rank", 0))


def install_on_worker(worker, name: str) -> int:
    """(collective_rpc) Install the oracle and plant ``name`` into this worker's runner; returns its rank."""
    from kvcanary.sim.vllm_bugs import plant
    from kvcanary.sim.vllm_oracle import ShadowOracle

    runner, rank = _runner(worker)
    oracle = ShadowOracle(runner).install()
    cm = plant(name, runner=runner, rank=rank)
    _LIVE["bug"] = (cm, cm.__enter__(), oracle)
    return rank


def collect_from_worker(worker) -> dict:
    """(collective_rpc) Remove the bug and the oracle from this worker; returns what they saw."""
    cm, state, oracle = _LIVE.pop("bug")
    cm.__exit__(None, None, None)
    oracle.uninstall()
    return {"rank": _runner(worker)[1], "fired": state.fired, "notes": state.notes[:3], "oracle": oracle.summary(),
            "error": oracle.error}


def tp_environment() -> dict:
    """What a tensor-parallel CPU engine needs here: one OpenMP thread set per rank."""
    return {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # (collective_rpc of the functions above)


def judge_tp(name: str, case, canary: bool, model_dir: str) -> dict:
    """``vllm_cases.judge`` for a case with ``case.tp`` ranks."""
    from kvcanary.sim.vllm_cases import PUBLISHED, Verdict, _canary_report, _line, canary_on
    from kvcanary.sim.vllm_drive import drive, make_llm

    t0 = time.perf_counter()
    os.environ.update(tp_environment())
    with canary_on() if canary else contextlib.nullcontext():
        llm = make_llm(model_dir, **case.engine)
        llm.collective_rpc(install_on_worker, args=(name,))
        error = ""
        try:
            drive(llm, list(case.arrivals))
        except Exception as e:  # judged all the same, as in vllm_cases.judge
            error = f"{type(e).__name__}: {e}"
        ranks = llm.collective_rpc(collect_from_worker)
        report = _canary_report(llm) if canary else None
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    bad = [r["error"] for r in ranks if r["error"]]
    if bad:
        raise RuntimeError(f"kv-canary: the shadow oracle failed on bug {name}: {bad[0]}")
    fired = sum(r["fired"] for r in ranks)
    wrong = sum(r["oracle"]["wrong_reads"] for r in ranks)
    violations = None if report is None else len(report.violations)
    verdict = "not fired" if not fired else "harmful" if wrong else "harmless"
    return vars(Verdict(
        name, verdict, fired, wrong, violations, None if violations is None or verdict != "harmful" else violations > 0,
        PUBLISHED.get(name, ""), [n for r in ranks for n in r["notes"]][:3],
        [f"rank {r['rank']}: {line}" for r in ranks for line in r["oracle"]["first"]][:3],
        [] if report is None else [_line(r) for r in report.violations[:3]], round(time.perf_counter() - t0, 1), error))
