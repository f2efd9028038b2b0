"""Tensor parallelism 2 on vLLM's multiprocess executor: each rank's worker process guards its own KV shard (the
canary arrives there through the plugin entry point), the ranks' canary states are compared
(kvcanary.distributed's ConsistencyCheck on vLLM's TP process group), and a bug planted on one rank only is
reported by that rank and named by the exchange. One engine (about 100 s to start on the 2-core dev machine)."""

import os

import pytest

from kvcanary.integrations.vllm import collect, engine, read_reports
from kvcanary.vllm_demo import plant_on_rank


@pytest.fixture(scope="module")
def tp2(model_dir):
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ALLOW_INSECURE_SERIALIZATION")}
    # one core per rank; the test hands a planting function to the workers (collective_rpc of a callable)
    os.environ.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    try:
        with engine.guarded(True, KV_CANARY_MODE="log", KV_CANARY_VLLM_TP_INTERVAL="4"):
            llm = engine.start(model_dir, tp=2, num_blocks=64, max_num_batched_tokens=64)
            yield llm
            engine.stop(llm)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _row(stats):
    return {s["rank"]: (s["violations"], s["tp_divergences"]) for s in stats}


def test_tp2_clean_then_a_bug_on_one_rank_is_named(tp2, prompts):
    out = engine.generate(tp2, prompts, max_tokens=8)
    clean = collect(tp2)
    assert len(out) == len(prompts)
    assert [s["rank"] for s in clean.stats] == [0, 1] and all(s["tp_size"] == 2 for s in clean.stats)
    assert clean.clean and _row(clean.stats) == {0: (0, 0), 1: (0, 0)}
    assert all(s["tp_exchanges"] >= 2 and s["forwards"] > 0 for s in clean.stats)
    assert clean.stats[0]["forwards"] == clean.stats[1]["forwards"]
    # rank 1's slot mapping goes wrong, rank 0's does not: only rank 1 reads wrong KV
    assert tp2.collective_rpc(plant_on_rank, args=("slot-off-by-one", 1)) == [False, True]
    assert tp2.reset_prefix_cache()
    engine.generate(tp2, prompts, max_tokens=8)
    report = collect(tp2)
    by_rank = {s["rank"]: s for s in report.stats}
    assert by_rank[0]["violations"] == 0 and by_rank[1]["violations"] > 0
    assert {r["rank"] for r in report.violations} == {1} and report.requests()
    # the exchange names rank 1: its records differ from rank 0's (no majority of two: rank 0 is the reference)
    assert report.divergences and {d["rank"] for d in report.divergences} == {1}
    assert any("records:full" in d["fields"] for d in report.divergences)


@pytest.mark.parametrize("rank", [1, 0])
def test_tp2_mode_raise_fails_the_engine_whichever_rank_finds_it(model_dir, prompts, tmp_path, monkeypatch, rank):
    """Mode raise with a bug on one rank only: the engine fails at that forward (vLLM's executor awaits rank 0's
    reply alone and only logs another rank's exception: raised there, the error left that rank a step behind and
    the engine hung). Rank 1 stops its worker; rank 0's error reaches the caller. The rows are on disk either way."""
    import vllm.envs

    for name, value in (("VLLM_CPU_OMP_THREADS_BIND", "0|1"), ("VLLM_ALLOW_INSECURE_SERIALIZATION", "1"),
                        ("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "90")):
        monkeypatch.setenv(name, value)
    # (a step that hangs ends in vLLM's own TimeoutError after 90 s instead of its default 300; vLLM caches its
    # variables once an engine has started: an earlier engine of this process read them)
    clear_cache = getattr(vllm.envs, "disable_envs_cache", lambda: None)
    clear_cache()
    reports = str(tmp_path / "reports")
    try:
        with engine.guarded(True, KV_CANARY_MODE="raise", KV_CANARY_VLLM_TP_INTERVAL="4",
                            KV_CANARY_VLLM_REPORT_DIR=reports):
            llm = engine.start(model_dir, tp=2, num_blocks=64, max_num_batched_tokens=64)
            try:
                engine.generate(llm, prompts[:3], max_tokens=4)  # clean: nothing raised
                assert llm.collective_rpc(plant_on_rank, args=("slot-off-by-one", rank)) == [rank == 0, rank == 1]
                assert llm.reset_prefix_cache()
                with pytest.raises(Exception) as failed:
                    engine.generate(llm, prompts, max_tokens=8)
                # the failure, not vLLM's timeout of a step that never ended
                assert not isinstance(failed.value, TimeoutError) and "timed out" not in str(failed.value)
                if rank == 0:  # its reply carries the error
                    assert "kv-canary" in str(failed.value) and "violation" in str(failed.value)
            finally:
                engine.stop(llm)
    finally:
        clear_cache()  # (the next engine reads the variables afresh, restored by then)
    found = read_reports(reports)
    assert found.violations and {r["rank"] for r in found.violations} == {rank}


def test_only_the_canarys_own_errors_end_a_worker_other_than_rank_0():
    """``abandon_step``'s rule without an engine: the canary's error (here end_step's) on rank 1 of 2 ends the
    process; the engine's own error there, or any error on rank 0 or without parallelism, goes back unchanged."""
    from types import SimpleNamespace

    from kvcanary.integrations.vllm.session import Session

    def session(rank, tp):
        closed = []
        s = SimpleNamespace(rank=rank, tp_size=tp, in_step=True, failure=None, engine_error=None,
                            _expect_forward=True, _step_forwards=0, closed=closed, close=lambda: closed.append(1))
        with pytest.raises(RuntimeError, match="must run a guarded forward") as own:
            Session.end_step(s)  # a step that scheduled tokens ran no guarded forward: the canary's error
        assert s.failure is own.value and not s.in_step
        return s, own.value

    s, own = session(rank=1, tp=2)
    with pytest.raises(SystemExit, match="rank 1 stopped its vLLM worker"):
        Session.abandon_step(s, own)
    assert s.closed == [1]  # rows and stats written before the process ends
    s, _ = session(rank=1, tp=2)
    Session.abandon_step(s, ValueError("the engine's"))  # not the canary's: vLLM gets it as it was
    s.failure = KeyboardInterrupt()  # (an interrupt, or vLLM's SystemExit at a shutdown signal, inside the hooks)
    Session.abandon_step(s, s.failure)
    assert not s.closed
    for rank, tp in ((0, 2), (0, 1)):
        s, own = session(rank=rank, tp=tp)
        Session.abandon_step(s, own)
        assert not s.closed
