"""Stable canary rows of the transformers adapter: assignment, reuse and eviction (no model needed)."""

import collections
from types import SimpleNamespace

import pytest
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
    b = BatchBuilder.__new__(BatchBuilder)  # the host half alone: no engine session, no device work
    b.init_rows(8)
    b.want_history, b.stage = True, Staging(torch.device("cpu"))
    ids = {}
    b.s = SimpleNamespace(ids=ids, request_id=lambda n: ids.setdefault(n, len(ids) + 1),
                          bp=SimpleNamespace(inputs_and_outputs=None))
    return b


def _run(b, scheduled):
    """One step: each (state, new tokens) advances its state's offset, then the host half runs."""
    for st, q in scheduled:
        st.position_offset += q
    b.s.bp.inputs_and_outputs = SimpleNamespace(requests_in_batch=[_Scheduled(st, q) for st, q in scheduled])
    return _unpack(b.host_part())


def _unpack(h):
    """A host part's valid lengths, token cells (row, column, token) and new tokens' batch indices."""
    p = h.unpack()
    cells = list(zip(p.cell_rows.tolist(), p.cell_cols.tolist(), p.cell_tokens.tolist()))
    return p.valid.tolist(), cells, p.token_req.tolist()


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


def _async_run(b, scheduled, pair, carried, padded=False):
    """One async step: the host half of the storage set ``pair``, the requests of ``carried`` having their newest
    token on the device only (sampled by the last forward: the engine's previous set lists them)."""
    aio = b.s.bp.inputs_and_outputs
    aio.current_pair = pair
    aio.io_pairs[1 - pair].host_io.req_id_to_new_token_position = {name: i for i, name in enumerate(carried)}
    for st, q in scheduled:
        st.position_offset += q
    aio.requests_in_batch = [_Scheduled(st, q) for st, q in scheduled]
    valid, cells, _ = _unpack(b.host_part(padded=padded))
    return valid, cells


def _async_builder(steady: bool):
    b = _host_builder()
    b.carries, b.pad_cap = True, 8
    pairs = [SimpleNamespace(host_io=SimpleNamespace(req_id_to_new_token_position={})) for _ in range(2)]
    b.s.bp.inputs_and_outputs = SimpleNamespace(io_pairs=pairs, current_pair=0, requests_in_batch=[],
                                                input_ids=torch.zeros(64), position_ids=torch.zeros(64),
                                                write_index_storage=torch.zeros(1, 64))
    if not steady:
        b._steady = lambda *args, **kwargs: None  # (every step on the general path)
    return b


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded-to-bucket"])
def test_async_decode_steps_send_each_rows_cell_one_step_late_on_the_steady_path_as_on_the_general_one(padded):
    # Under async batching a request's newest input token is carried over on the device: the host learns it
    # one update later. Each decode step must send the cell one position back with a valid length one short,
    # and the steady path (a kept array, no per-request Python) must send what the general path sends.
    runs = {}
    for steady in (False, True):
        b = _async_builder(steady)
        a, c, e = _State("a", [5, 6, 7]), _State("c", [1, 2]), _State("e", [3])
        steps = [_async_run(b, [(a, 3), (c, 2), (e, 1)], 0, [])]  # the prompts: nothing carried, every cell known
        for step in range(6):
            # forward `step` sampled a token for each request (carried into this one); the host knows the
            # tokens of the forwards before it
            if step:
                for st, base in zip((a, c, e), (8, 4, 2)):
                    st.generated_tokens.append(base * 10 + step - 1)
            steps.append(_async_run(b, [(a, 1), (c, 1), (e, 1)], (step + 1) % 2, ["a", "c", "e"], padded))
        b.sync_sent()  # (the bookkeeping the steady path defers)
        runs[steady] = (steps, dict(b.sent), [b.row_of[n] for n in "ace"], b.steady is not None)
    assert runs[True][-1] and not runs[False][-1]  # (the steady path ran where it may)
    assert runs[True][:-1] == runs[False][:-1]
    steps, sent, rows, _ = runs[True]
    assert steps[0][0] == [3, 2, 1]  # the prompts' cells all sent
    assert steps[1][0][:3] == [3, 2, 1] and not [cell for cell in steps[1][1] if cell[0]]  # (its input is carried)
    for step in range(1, 6):
        valid, cells = steps[step + 1]
        # offsets 3, 2 and 1 + step + 1; each row holds every position but the newest (a padding request: valid
        # length 0, a cell of token 0 in the padding row's column 0)
        assert valid == [3 + step, 2 + step, 1 + step] + [0] * padded
        assert [cell for cell in cells if cell[0]] == [(row, n0 - 1 + step, base * 10 + step - 1)
                                                      for row, n0, base in zip(rows, (3, 2, 1), (8, 4, 2))]
    assert sent == {"a": 8, "c": 7, "e": 6}


def test_staging_sized_for_the_canary_limits_never_grows_within_them():
    # A prefill's chunks grew the staging buffers several times a session (each growth a new pinned and device
    # buffer per turn, allocated inside the step); sized for the canary's limits, steps within them reuse the
    # first buffers, and a larger step (a cached prefix's tokens) still grows them.
    stage = Staging(torch.device("cpu"), depth=3)
    grown = []
    stage.on_alloc = lambda *bufs: grown.append(len(bufs))
    stage.sized_for(max_batch=8, max_tokens=512)
    for n in (3, 40, 600, 9 * 8 + 4 * 512):
        view, _ = stage.send([list(range(n))])
        assert view.tolist() == list(range(n))
    assert grown == [4] and stage.size == 9 * 8 + 4 * 512
    stage.send([list(range(stage.size + 1))])
    assert grown == [4, 4]
