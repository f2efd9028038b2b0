"""Stable canary rows of the transformers adapter: assignment, reuse and eviction (no model needed)."""

import collections

import torch

from kvcanary.integrations.hf_batch import BatchBuilder, Staging
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
