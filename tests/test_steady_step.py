"""The CPU's steady step (``runtime/step/steady.py``): decode steps run from a bound plan leave the canary records,
violation rows and stats the eager path leaves, clean and with planted bugs, and steady steps do take it."""

import dataclasses

import pytest
import torch

pytest.importorskip("numba")

from kvcanary.runtime.step.steady import SteadyStep  # noqa: E402
from kvcanary.sim.config import SimConfig  # noqa: E402
from kvcanary.sim.engine import SimEngine, default_canary_config  # noqa: E402
from test_step_runner import flip_live_kv  # noqa: E402  (one plant for both files)

CFG = dict(seed=38, page_size=4, num_slots=512, num_requests=4, max_running=4, max_output=32, max_steps=60)


def sim_run(steady: bool, bug=None, flip=False):
    cfg = SimConfig(bug=bug, **CFG)
    # numba (the steady step's backend); no allocator check: a step it checks closes eagerly
    e = SimEngine(cfg, default_canary_config(cfg).replace(backend="numba", allocator_check_interval=0), steps="eager")
    if not steady:
        e.runner.steady = None
    if flip:
        flip_live_kv(e, 12)
    result = e.run()
    return e, result


def outcome(canary, tokens) -> tuple:
    records = {(g.name, key): buf.clone() for g in canary.groups for key, buf in g.bufs.items()}
    rows = [dataclasses.astuple(v) for v in canary.violations]  # (in order: both paths push the same rows)
    return records, rows, [v.block() for v in canary.violations], canary.stats(), tokens


def same(a: tuple, b: tuple) -> None:
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert a[1:] == b[1:]


@pytest.mark.parametrize("case", ["clean", "flip-kv", "stale_table_tail"])
def test_sim_steady_steps_leave_what_eager_steps_leave(case):
    bug, flip = (case, False) if case not in ("clean", "flip-kv") else (None, case == "flip-kv")
    got = {}
    for steady in (True, False):
        e, result = sim_run(steady, bug, flip)
        got[steady] = outcome(e.canary, result.tokens_protected)
        if steady:
            # the path was taken (counters, not times); a step whose observation holds rows closes eagerly
            assert e.runner.steady.taken > 10 and (e.runner.steady.closed > 10 or case != "clean")
    same(got[True], got[False])
    assert (len(got[True][1]) > 0) == (case != "clean")  # (the planted bug is found; the clean run is clean)


def test_the_steady_step_needs_the_cpu_eager_compiled_path():
    cfg = SimConfig(**CFG)
    torch_run = SimEngine(cfg, default_canary_config(cfg), steps="eager")  # (the sim's default: torch)
    assert torch_run.runner.steady is None and not SteadyStep.applies(torch_run.runner)


def hf_run(steady: bool, bug=None, **kw):
    pytest.importorskip("transformers")
    from kvcanary.demo import build_tiny_model, run_workload
    from kvcanary.integrations.transformers import session as S
    from kvcanary.integrations.transformers.handle import tuned

    seen = {}
    close = S.Session.close

    def closing(self):  # (the canary's records before the session drops it)
        if not self.closed:
            self.canary.flush()
            seen["out"] = outcome(self.canary, None)
            seen["steady"] = self.runner.steady
        close(self)

    S.Session.close = closing
    try:
        with tuned(steady_steps=steady):
            r = run_workload(build_tiny_model("cpu"), bug=bug, **{"max_new_tokens": 14, "num_return_sequences": 1, **kw})
    finally:
        S.Session.close = close
    return seen, r


@pytest.mark.parametrize("bug", [None, "flip-kv", "never-written", "new-token-read-index"])
def test_transformers_steady_steps_leave_what_eager_steps_leave(bug):
    on, r_on = hf_run(True, bug)
    off, r_off = hf_run(False, bug)
    same(on["out"], off["out"])
    assert r_on.tokens == r_off.tokens and r_on.stats == r_off.stats
    assert (len(on["out"][1]) > 0) == (bug is not None)
    assert on["steady"].taken > 0 and on["steady"].closed > 0 and off["steady"] is None


def test_the_steady_step_honours_the_new_reads_shortcut_switch(monkeypatch):
    # The CPU shortcut of the new tokens' read check skips its verify (runtime/step/tables.py): entries_checked
    # counts only what a verify compared. Turned off (as the tests comparing captured steps with an eager run do),
    # the steady step must run that verify as the full path does, or the routes count different entries (an eager
    # numba run of prefill chunks once counted 2,548 against the captured Triton run's 2,646).
    from kvcanary.runtime.step.tables import StepTables

    g = torch.Generator().manual_seed(5)
    kw = dict(prompts=[torch.randint(5, 200, (48,), generator=g).tolist() for _ in range(4)], max_new_tokens=4)
    short, _ = hf_run(True, **kw)
    monkeypatch.setattr(StepTables, "new_reads_shortcut", False)
    on, r_on = hf_run(True, **kw)
    off, r_off = hf_run(False, **kw)
    same(on["out"], off["out"])
    assert r_on.tokens == r_off.tokens and r_on.stats == r_off.stats
    assert on["steady"].taken > 0 and off["steady"] is None
    # (the switch changes the count: the shortcut had skipped verifies on both routes)
    assert short["out"][3]["entries_checked"] < on["out"][3]["entries_checked"]
