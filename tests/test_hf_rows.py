"""Stable canary rows of the transformers adapter: assignment, reuse and eviction (no model needed)."""

import collections

import torch

from kvcanary.integrations.transformers.batch import BatchBuilder
from kvcanary.runtime.step.staging import Staging
from kvcanary.runtime.monitor import KEEP_BATCHES


def _builder(num_rows: int) -> BatchBuilder:
    b = BatchBuilder.__new__(BatchBuilder)  # only the row bookkeeping, without an engine session
    b.num_rows, b.row_of, b.sent = num_rows, collections.OrderedDict(), {}
    b.free = list(range(num_rows - 1, 0, -1))
    return b


def test_a_request_keeps_its_row_and_new_requests_take_free_ones():
    b = _builder(5)
    first = b._rows(["a", "b"])
    b.sent["a"] = 7  # a's tokens are in its row
    assert b._rows(["b", "a", "c"]) == [first[1], first[0], b.row_of["c"]]
    assert len(set(b.row_of.values())) == 3 and 0 not in b.row_of.values() and b.sent["a"] == 7


def test_rows_run_out_evict_the_least_recent_request_outside_the_batch():
    b = _builder(4)  # rows 1..3
    b._rows(["a", "b", "c"])
    for name in "abc":
        b.sent[name] = 5
    b._rows(["a"])  # a is now the most recent; b the least
    rows = b._rows(["d", "c"])
    assert "b" not in b.row_of and "b" not in b.sent  # evicted: its row no longer holds its tokens
    assert b.sent["d"] == 0 and len(set(rows)) == 2
    # b comes back: a row is freed from the least recent request outside the batch (a), and b resends all
    rows = b._rows(["b", "c", "d"])
    assert "a" not in b.row_of and b.sent["b"] == 0 and len(set(rows)) == 3


def test_staged_batches_stay_intact_while_the_monitor_may_read_them():
    # Violations reach the monitor steps after their forward (CUDA), which then reads that step's batch:
    # the staged tensors of the last KEEP_BATCHES steps must still hold what was sent, and a step that
    # outgrows the buffers must not disturb them either.
    stage = Staging(torch.device("cpu"))
    sent = [[step * 100 + i for i in range(3 + step)] for step in range(KEEP_BATCHES)]
    views = [stage.send([small])[0] for small in sent]
    views.append(stage.send([list(range(5000))])[0])  # larger than the first buffers: a new ring
    sent.append(list(range(5000)))
    for small, view in zip(sent, views):
        assert view.tolist() == small
    later = [stage.send([[-step] * 4])[0] for step in range(KEEP_BATCHES)]
    assert views[-1].tolist() == sent[-1] and [v.tolist() for v in later] == [[-s] * 4 for s in range(KEEP_BATCHES)]


class _State:  # the fields of a transformers RequestState the host half reads
    def __init__(self, name, prompt):
        self.request_id, self.initial_tokens, self.generated_tokens = name, prompt, []
        self.position_offset = 0


class _Scheduled:  # a FutureRequestState
    def __init__(self, state, query_length):
        self.state, self.query_length = state, query_length


def _host_builder():
    from types import SimpleNamespace

    import numpy as np

    b = BatchBuilder.__new__(BatchBuilder)  # the host half alone: no engine session, no device work
    b.init_rows(8)
    b.want_history, b.stage, b.iota_np = True, Staging(torch.device("cpu")), np.arange(4, dtype=np.int64)
    ids = {}
    b.s = SimpleNamespace(ids=ids, request_id=lambda n: ids.setdefault(n, len(ids) + 1),
                          bp=SimpleNamespace(inputs_and_outputs=None))
    return b


def _run(b, scheduled):
    """One step: each (state, new tokens) advances its state's offset, then the host half runs."""
    from types import SimpleNamespace

    for st, q in scheduled:
        st.position_offset += q
    b.s.bp.inputs_and_outputs = SimpleNamespace(requests_in_batch=[_Scheduled(st, q) for st, q in scheduled])
    h = b.host_part()
    values = h.packed.tolist()
    k = (h.small - h.n - h.bs) // 3  # token cells
    c0 = h.n + h.bs
    cells = list(zip(values[c0:c0 + k], values[c0 + k:c0 + 2 * k], values[c0 + 2 * k:c0 + 3 * k]))
    return values[h.n:h.n + h.bs], cells, values[h.small:]


def test_a_step_of_as_many_tokens_as_requests_but_not_one_each_is_packed_per_request():
    # Two decode steps of the same requests make the next one a candidate for the steady path, which
    # assumes one new token per request. A step with as many tokens as requests, but 2 for one and 0
    # for the other, must take the general path: its cells and token batch indices are per request.
    b = _host_builder()
    a, c = _State("a", [5, 6, 7]), _State("c", [1, 2, 3])
    _run(b, [(a, 3), (c, 3)])  # the prompts
    for step in range(2):  # two decode steps of one token each
        a.generated_tokens.append(8 + step)
        c.generated_tokens.append(4 + step)
        valid, cells, token_req = _run(b, [(a, 1), (c, 1)])
        assert token_req == [0, 1] and [t for _, _, t in cells] == [8 + step, 4 + step]
    row_a = b.row_of["a"]
    a.generated_tokens += [10, 11]
    c.generated_tokens.append(6)  # (sampled, not fed this step)
    valid, cells, token_req = _run(b, [(a, 2), (c, 0)])
    assert valid == [7, 5]
    assert cells == [(row_a, 5, 10), (row_a, 6, 11)]  # a's two positions, nothing for c
    assert token_req == [0, 0]  # both new tokens are a's
