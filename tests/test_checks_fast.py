"""The compiled yes-or-no pass of the CPU's value checks (runtime/checks.py, ``batch_ok``) says yes exactly where
every Python check of ``check_batch_values`` passes: on a valid batch and on each kind of bad value."""

import pytest
import torch

pytest.importorskip("numba")

from kvcanary.runtime import checks  # noqa: E402
from kvcanary.runtime.batch import ForwardBatch, TokenAppend, TokenHistory  # noqa: E402

NUM_ROWS, NUM_SLOTS, MAX_CONTEXT = 8, 100, 32
LIMITS = dict(num_rows=NUM_ROWS, num_slots=NUM_SLOTS, max_context=MAX_CONTEXT)


def t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


def batch(rows=(3, 5, 0), prefix=(4, 0, 0), extend=(1, 2, 1), loc=(7, 8, 9, -1), cells=((3, 5, 5), (4, 0, 1)),
          valid=(5, 2, 0), table=(NUM_ROWS, MAX_CONTEXT), dtype=torch.int64, ids=None, cell_tokens=None):
    n = len(loc)
    tokens = [9] * len(cells[0]) if cell_tokens is None else cell_tokens
    hist = TokenAppend(t(cells[0], dtype), t(cells[1], dtype), t(tokens, dtype), t(valid, dtype))
    return ForwardBatch(req_pool_indices=t(rows, dtype), prefix_lens=t(prefix, dtype), extend_lens=t(extend, dtype),
                        input_ids=t([1] * n if ids is None else ids), positions=t([0] * n), out_cache_loc=t(loc, dtype),
                        req_to_token=torch.zeros(table, dtype=torch.int64), token_history=hist)


def python_checks_pass(b) -> bool:
    ok = checks.batch_ok
    checks.batch_ok = lambda *a: False  # (the Python checks alone)
    try:
        checks.check_batch_values(b, **LIMITS)
        return True
    except ValueError:
        return False
    finally:
        checks.batch_ok = ok


CASES = {
    "valid": {},
    "row past the table": dict(rows=(3, 8, 0)),
    "row past a narrow table": dict(table=(5, MAX_CONTEXT)),
    "negative row": dict(rows=(-1, 5, 0)),
    "negative prefix": dict(prefix=(-1, 0, 0), extend=(2, 2, 0)),
    "negative extend": dict(extend=(2, 2, -1)),
    "wider than the table": dict(prefix=(32, 0, 0)),
    "as wide as the table": dict(prefix=(31, 0, 0)),
    "row 0 with a prefix": dict(prefix=(4, 0, 1), extend=(1, 2, 1)),
    "request after padding": dict(rows=(0, 5, 3), prefix=(0, 0, 4)),
    "tokens not adding up": dict(loc=(7, 8, 9)),
    "slot past the pool": dict(loc=(7, 8, NUM_SLOTS, -1)),
    "no write is fine": dict(loc=(-5, -1, -1, -1)),
    # a padding request's token (row 0, last) is never written: its slot may be anything (a batch padded to
    # its size bucket reads stale cells of the engine's write index there); a real token's may not
    "padding slot past the pool": dict(loc=(7, 8, 9, NUM_SLOTS + 5)),
    "slot past the pool before padding": dict(loc=(7, 8, NUM_SLOTS, 3)),
    "cell row past the rows": dict(cells=((3, NUM_ROWS, 5), (4, 0, 1))),
    "cell column past the context": dict(cells=((3, 5, 5), (4, MAX_CONTEXT, 1))),
    "negative cell column": dict(cells=((3, 5, 5), (4, -2, 1))),
    "valid length past the context": dict(valid=(5, MAX_CONTEXT + 1, 0)),
    "valid length at the context": dict(valid=(5, MAX_CONTEXT, 0)),
    "no cells": dict(cells=((), ())),
    # token ids beyond the int32 token table (issue 56): refused, not wrapped into false verify_token rows
    "input id past int32": dict(ids=(1, 2**31, 3, 4)),
    "negative input id": dict(ids=(1, 2, -1, 4)),
    "largest input id": dict(ids=(1, 2**31 - 1, 3, 4)),
    "padding input id": dict(ids=(1, 2, 3, -1)),  # (a padding request's token: never written nor read)
    "history token past int32": dict(cell_tokens=(9, 2**31, 9)),
    "negative history token": dict(cell_tokens=(9, -1, 9)),
    "missing history token": dict(cell_tokens=(9, -2, 9)),  # (report.MISSING_TOKEN: a gap the adapter marks)
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_pass_says_yes_exactly_where_the_python_checks_pass(case):
    b = batch(**CASES[case])
    expected = python_checks_pass(b)
    assert checks.batch_ok(b, **LIMITS) == expected
    assert expected == (case in ("valid", "as wide as the table", "no write is fine", "valid length at the context",
                                 "no cells", "padding slot past the pool", "largest input id", "padding input id",
                                 "missing history token"))
    if not expected:  # the checks still raise their own error with the pass in front of them
        with pytest.raises(ValueError, match="kv-canary"):
            checks.check_batch_values(b, **LIMITS)


def test_int32_input_ids_are_judged_by_the_compiled_pass():
    # (transformers' input ids are int32: the pass judges them rather than sending every step to Python)
    b = batch()
    b.input_ids = b.input_ids.to(torch.int32)
    assert checks.batch_ok(b, **LIMITS)
    b.input_ids[1] = -3
    assert not checks.batch_ok(b, **LIMITS) and not python_checks_pass(b)


def test_batches_it_does_not_judge_go_to_the_python_checks():
    assert not checks.batch_ok(batch(dtype=torch.int32), **LIMITS)  # other dtypes
    b = batch()
    b.token_history = TokenHistory(flat=t([1, 2, 3]), offsets=t([0, 1, 2, 3]))
    assert not checks.batch_ok(b, **LIMITS)  # a whole history per forward
    b.token_history = None
    assert not checks.batch_ok(b, **LIMITS)
    checks.check_batch_values(batch(dtype=torch.int32), **LIMITS)  # (valid: the Python checks pass it)


def test_the_compiled_pass_agrees_with_the_python_checks_on_random_batches():
    # random small batches around the limits (rows, lengths, slots, token cells, valid lengths): the pass
    # says yes exactly where the Python checks pass
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    small = st.integers(-2, 12)

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
    @hypothesis.given(st.lists(st.tuples(st.integers(-1, NUM_ROWS), small, st.integers(-1, 4)), min_size=1,
                               max_size=4),
                      st.integers(-1, 2), st.lists(st.integers(-1, NUM_SLOTS), max_size=12),
                      st.lists(st.tuples(st.integers(-1, NUM_ROWS), st.integers(-1, MAX_CONTEXT)), max_size=4),
                      st.lists(st.integers(-1, MAX_CONTEXT + 1), min_size=1, max_size=4))
    def check(reqs, extra, loc, cells, valid):
        rows, prefix, extend = zip(*reqs)
        n = max(0, sum(extend) + extra)
        locs = (loc + [5] * n)[:n]
        cell_rows, cell_cols = (tuple(c) for c in zip(*cells)) if cells else ((), ())
        b = batch(rows=rows, prefix=prefix, extend=extend, loc=locs, cells=(cell_rows, cell_cols), valid=valid)
        passed = python_checks_pass(b)
        outcomes.add(passed)
        assert checks.batch_ok(b, **LIMITS) == passed

    outcomes = set()
    check()
    assert outcomes == {True, False}  # (both kinds of batch were met)
