"""vLLM's forwards come through the runtime's host step (``runtime.engine.HostStep``, issue 57): the vLLM adapter
packs each canary forward (a whole forward, or one wave of it) with ``HostStep.pack``, the packed record unpacks to
what vLLM's attention metadata and input batch say, and the ``ForwardBatch`` the canary checks is the one the
runtime's ``StepTables`` builds from it. No vLLM needed: the metadata here has the fields the adapter reads."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvcanary import Canary, CanaryConfig, PoolSpec
from kvcanary.integrations.vllm.batch import BatchBuilder, waves
from kvcanary.integrations.vllm.report import RequestNames
from kvcanary.runtime.batch import TokenAppend
from kvcanary.runtime.step.tables import StepTables
from kvcanary.sim.zoo import quiet_and_single_threaded

B = 4  # slots per block
CONTEXT = 16


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_and_single_threaded():
        yield


def _canary():
    canary = Canary(PoolSpec(64), CanaryConfig(mode="log", health_interval=0), max_batch=4, max_tokens=16,
                    max_context=CONTEXT, num_rows=5, device="cpu")
    canary.mark_ready()
    return canary


def _builder(canary):
    b = BatchBuilder(max_batch=4, max_tokens=16, max_context=CONTEXT, block_size=B, num_slots=64, layer_name="l0",
                     names=RequestNames(), history=True)
    return b, StepTables(canary, b)


def _forward(b, reqs, tokens, known=None):
    """A forward as vLLM's metadata gives it: ``reqs`` of (vLLM id, prefix, extend, block ids), ``tokens`` the input
    batch's token rows; the slot mapping and positions follow the block tables."""
    n = len(reqs)
    qlen = [e for _, _, e, _ in reqs]
    seq = [p + e for _, p, e, _ in reqs]
    table = torch.zeros(n, 4, dtype=torch.int32)
    for r, (_, _, _, blocks) in enumerate(reqs):
        table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    pos = [q for _, p, e, _ in reqs for q in range(p, p + e)]
    slots = [blocks[q // B] * B + q % B for _, p, e, blocks in reqs for q in range(p, p + e)]
    ids = [tokens[r][q] for r, (_, p, e, _) in enumerate(reqs) for q in range(p, p + e)]
    md = SimpleNamespace(query_start_loc=torch.tensor([0] + list(np.cumsum(qlen)), dtype=torch.int32),
                         seq_lens=torch.tensor(seq, dtype=torch.int32), block_table=table, num_actual_tokens=len(pos))
    rows = np.zeros((n, CONTEXT), dtype=np.int32)
    for r, t in enumerate(tokens):
        rows[r, :len(t)] = t
    ib = SimpleNamespace(num_reqs=n, req_ids=[name for name, _, _, _ in reqs], token_ids_cpu=rows,
                         num_tokens_no_spec=np.array(seq if known is None else known, dtype=np.int64))
    return b.forward_of(md, torch.tensor(slots, dtype=torch.int64), ib, torch.tensor(ids, dtype=torch.int32),
                        torch.tensor(pos, dtype=torch.int64))


def _step(b, tables, fwd, idx=None):
    b.set_wave(fwd, idx)
    h = b.host_part()
    return h, tables.build(h, None)


TOKENS = [[7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [7, 8, 9, 10, 30]]
# request a: prefix 5 (blocks 2, 3), writes positions 5 and 6; b: a fresh prefill of 3 (block 5); c: a prefix hit of
# block 2, writes position 4 (block 6)
REQS = [("a", 5, 2, [2, 3]), ("b", 0, 3, [5]), ("c", 4, 1, [2, 6])]


def test_the_packed_host_step_unpacks_to_what_vllms_metadata_says():
    b, tables = _builder(_canary())
    fwd = _forward(b, REQS, TOKENS)
    h, batch = _step(b, tables, fwd)
    p = h.unpack()
    assert p.rows.tolist() == [1, 2, 3]  # request r in row r + 1
    assert p.prefix.tolist() == [5, 0, 4] and p.extend.tolist() == [2, 3, 1]  # seq_lens - query lengths, query lengths
    assert p.rids.tolist() == [b.names.number(n) for n in "abc"] == [1, 2, 3]
    assert p.token_req.tolist() == [0, 0, 1, 1, 1, 2]
    # each request's whole history as token cells of its row, valid up to its known tokens
    assert p.valid.tolist() == [7, 3, 5]
    cells = {(r, c): t for r, c, t in zip(p.cell_rows.tolist(), p.cell_cols.tolist(), p.cell_tokens.tolist())}
    assert cells == {(r + 1, c): t for r, row in enumerate(TOKENS) for c, t in enumerate(row)}
    assert (h.bs, h.T, h.width, h.total, h.pad) == (3, 6, 7, 15, 0)
    # the batch the canary checks: the runtime's views of the packed record and the step's inputs
    assert batch.req_pool_indices.data_ptr() == h.packed.data_ptr()
    assert batch.out_cache_loc.tolist() == [13, 14, 20, 21, 22, 24]  # the slot mapping
    assert batch.input_ids.tolist() == [12, 13, 20, 21, 22, 30] and batch.positions.tolist() == [5, 6, 0, 1, 2, 4]
    assert batch.expected_input_ids.tolist() == [12, 13, 20, 21, 22, 30]
    assert batch.expected_positions.tolist() == [5, 6, 0, 1, 2, 4]
    assert isinstance(batch.token_history, TokenAppend)
    # the read table: block_table[r, p // B] * B + p % B for every position below seq_lens[r]
    for r, (_, pre, ext, blocks) in enumerate(REQS):
        want = [blocks[q // B] * B + q % B for q in range(pre + ext)]
        assert batch.req_to_token[r + 1, :pre + ext].tolist() == want


def test_a_wave_is_a_host_step_of_its_requests_tokens_and_reads():
    b, tables = _builder(_canary())
    fwd = _forward(b, REQS, TOKENS)
    assert fwd.tokens([2, 0]).tolist() == [5, 0, 1]  # (the write check's notes of the wave, in its token order)
    h, batch = _step(b, tables, fwd, [2, 0])
    p = h.unpack()
    assert p.rows.tolist() == [3, 1] and p.prefix.tolist() == [4, 5] and p.extend.tolist() == [1, 2]
    assert p.rids.tolist() == [3, 1] and p.valid.tolist() == [5, 7] and p.token_req.tolist() == [0, 1, 1]
    assert p.cell_rows.tolist() == [3] * 5 + [1] * 7 and p.cell_tokens.tolist() == TOKENS[2] + TOKENS[0]
    assert batch.out_cache_loc.tolist() == [24, 13, 14] and batch.input_ids.tolist() == [30, 12, 13]
    assert batch.expected_positions.tolist() == [4, 5, 6] and h.total == 12
    assert batch.req_to_token[3, :5].tolist() == [8, 9, 10, 11, 24]
    assert batch.req_to_token[1, :7].tolist() == [8, 9, 10, 11, 12, 13, 14]


def test_waves_follow_blocks_written_in_the_same_forward():
    b, _ = _builder(_canary())
    assert waves(_forward(b, REQS, TOKENS), B) == [[0, 1, 2]]  # (block 2 was written before this forward)
    # x writes block 7; y reads it as its prefix (a hit on a block scheduled in the same step) and writes block 8
    fwd = _forward(b, [("x", 0, 4, [7]), ("y", 4, 1, [7, 8])], [[1, 2, 3, 4], [1, 2, 3, 4, 5]])
    assert waves(fwd, B) == [[0], [1]]


def test_the_canary_checks_the_built_batches_and_sees_a_wrong_block_table_entry():
    canary = _canary()
    b, tables = _builder(canary)
    for fwd in (_forward(b, [("a", 0, 5, [2, 3])], [TOKENS[0][:5]]),  # prefill, then a decode reading it
                _forward(b, [("a", 5, 1, [2, 3])], [TOKENS[0][:6]])):
        _, batch = _step(b, tables, fwd)
        canary.before_forward(batch)
        canary.after_forward(batch)
    canary.flush()
    assert canary.stats()["violations"] == 0
    # request c maps block 4 (never written) where its prefix's first block is: every read of it is reported (and its
    # new token's write at slot 24, whose chain follows them)
    _, batch = _step(b, tables, _forward(b, [("c", 4, 1, [4, 6])], [TOKENS[0][:4] + [30]]))
    canary.before_forward(batch)
    canary.after_forward(batch)
    canary.flush()
    assert canary.stats()["violations"] > 0
    assert {16, 17, 18, 19} <= {v.slot for v in canary.violations} <= {16, 17, 18, 19, 24}
