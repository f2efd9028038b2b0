"""The transformers adapter's per-step arrays (read table, token cells) and the readable report, without a model."""

from types import SimpleNamespace

import pytest
import torch

from kvcanary.format import CHAIN_HEAD, FailReason
from kvcanary.integrations.transformers.batch import BatchBuilder
from kvcanary.runtime.step.tables import StepTables
from kvcanary.runtime.report import MISSING_TOKEN, Violation

B = 4  # block size


def builder(num_rows=7, num_slots=64) -> BatchBuilder:
    b = BatchBuilder.__new__(BatchBuilder)  # the array code only, without an engine session
    b.num_rows, b.device = num_rows, torch.device("cpu")
    b.init_rows(num_rows)
    b.s = SimpleNamespace(layout=SimpleNamespace(full_group=0, block_size=B, num_slots=num_slots))
    return b


def tables(num_rows=7, num_slots=64) -> StepTables:
    t = StepTables.__new__(StepTables)  # the read table alone, without a runner
    t.num_rows, t.device = num_rows, torch.device("cpu")
    t.group, t.block_size, t.num_slots = 0, B, num_slots
    t.in_block = torch.arange(B)
    t.iota = torch.arange(4)
    t.warned_read_size = False
    return t


def slots_of(blocks, n):
    return [blocks[p // B] * B + p % B for p in range(n)]


# Three requests in canary rows 5, 2, 3: prefix + extend lengths and their (non-contiguous) blocks.
ROWS, PREFIX, EXTEND = [5, 2, 3], [6, 0, 9], [1, 3, 1]
BLOCKS = [[3, 9], [4], [7, 2, 11]]


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "tensor-ops"])
def test_read_table_is_built_from_the_read_index_attention_consumes(host):
    reads = [slots_of(bl, p + q) for bl, p, q in zip(BLOCKS, PREFIX, EXTEND)]
    reads[2][4] = 40  # the engine's read index disagrees with its block table at one cell
    flat = [s for r in reads for s in r]
    storage = torch.full((1, 64), -7, dtype=torch.int64)
    storage[0, :len(flat)] = torch.tensor(flat)
    io = SimpleNamespace(use_block_table=False, max_kv_read=sum(PREFIX), read_index_storage=storage,
                         true_read_sizes=[len(flat)])
    b = tables()
    rtt = b._read_table(io, torch.tensor(ROWS), torch.tensor(PREFIX), torch.tensor(EXTEND),
                        max(p + q for p, q in zip(PREFIX, EXTEND)), len(flat), host=host)
    for row, r in zip(ROWS, reads):
        assert rtt[row, :len(r)].tolist() == r  # the read index, cell for cell (40 included)


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "tensor-ops"])
def test_a_short_read_index_leaves_out_of_range_cells_that_fail_verification(host):
    reads = [slots_of(bl, p + q) for bl, p, q in zip(BLOCKS, PREFIX, EXTEND)]
    flat = [s for r in reads for s in r][:-2]  # the last request misses its last two cells
    storage = torch.zeros((1, 64), dtype=torch.int64)
    storage[0, :len(flat)] = torch.tensor(flat)
    io = SimpleNamespace(use_block_table=False, max_kv_read=1, read_index_storage=storage,
                         true_read_sizes=[len(flat)])
    b = tables(num_slots=64)
    rtt = b._read_table(io, torch.tensor(ROWS), torch.tensor(PREFIX), torch.tensor(EXTEND), 10, len(flat) + 2,
                        host=host)
    assert rtt[3, :10].tolist() == reads[2][:8] + [64, 64]
    assert rtt[5, :7].tolist() == reads[0]


def test_read_table_on_the_flash_path_uses_the_io_block_table():
    table = torch.full((1, 8, 5), -1, dtype=torch.int32)
    for i, bl in enumerate(BLOCKS):
        table[0, i, :len(bl)] = torch.tensor(bl, dtype=torch.int32)
    io = SimpleNamespace(use_block_table=True, block_table=table)
    rtt = tables()._read_table(io, torch.tensor(ROWS), torch.tensor(PREFIX), torch.tensor(EXTEND), 10, 0)
    for row, bl, p, q in zip(ROWS, BLOCKS, PREFIX, EXTEND):
        assert rtt[row, :p + q].tolist() == slots_of(bl, p + q)


def fake_request(name, init, gen, prefix, extend):
    return SimpleNamespace(state=SimpleNamespace(request_id=name, initial_tokens=init, generated_tokens=gen),
                           query_length=extend, prefix=prefix)


def test_a_short_history_only_marks_its_own_request():
    b = builder()
    good1 = fake_request("a", [10, 11, 12], [13, 14], 4, 1)
    short = fake_request("b", [20, 21], [22], 3, 1)  # positions [0, 4) fed, the history holds 3 tokens
    good2 = fake_request("c", [30, 31, 32, 33], [], 0, 4)
    long_short = fake_request("d", list(range(100, 180)), [], 0, 81)  # a prefill chunk, one token short
    reqs = [good1, short, good2, long_short]
    names = [r.state.request_id for r in reqs]
    rows = b._rows(names)
    parts = b._token_cells(reqs, names, rows, [r.prefix for r in reqs], [r.query_length for r in reqs])
    cells = [int(x) for p in parts for x in p]
    bs = len(reqs)
    valid, rest = cells[:bs], cells[bs:]
    k = len(rest) // 3
    table = {(r, c): t for r, c, t in zip(rest[:k], rest[k:2 * k], rest[2 * k:])}
    assert valid == [5, 4, 4, 81] and len(rest) == 3 * k == 3 * (5 + 4 + 4 + 81)
    assert [table[rows[0], c] for c in range(5)] == [10, 11, 12, 13, 14]
    assert [table[rows[1], c] for c in range(4)] == [20, 21, 22, MISSING_TOKEN]
    assert [table[rows[2], c] for c in range(4)] == [30, 31, 32, 33]
    assert [table[rows[3], c] for c in range(81)] == list(range(100, 180)) + [MISSING_TOKEN]


def cells_of(parts) -> list[int]:
    return [int(x) for p in parts for x in p]


@pytest.mark.parametrize("short", [False, True], ids=["steady", "one-history-short"])
def test_the_decode_fast_path_packs_what_the_general_path_packs(short):
    # a decode step of requests whose rows hold every earlier token: C loops only, unless some
    # request breaks the pattern (a short history here), which the general path then handles
    def step_requests():
        return [fake_request("a", [10, 11, 12], [13, 14], 4, 1),
                fake_request("b", [20, 21], [22, 23, 24][:2 if short else 3], 4, 1),
                fake_request("c", [30, 31, 32, 33], [34], 4, 1)]

    results = []
    for decode in (True, False):
        b = builder()
        reqs = step_requests()
        names = [r.state.request_id for r in reqs]
        rows = b._rows(names)
        for name in names:
            b.sent[name] = 4  # positions [0, 4) already in the rows
        calls = []
        fast = b._decode_cells
        b._decode_cells = lambda *a: calls.append(fast(*a)) or calls[-1]
        parts = b._token_cells(reqs, names, rows, [4, 4, 4], [1, 1, 1], decode)
        results.append((cells_of(parts), dict(b.sent)))
        if decode:
            assert (calls[0] is None) == short  # the fast path steps aside for the short history
    assert results[0] == results[1]
    tokens = results[0][0][-3:]
    assert tokens == [14, MISSING_TOKEN if short else 24, 34]


def row(tag=0, slot=9, position=4, stored=7, expected=-1, chain=CHAIN_HEAD, aux=CHAIN_HEAD, bits=0):
    return [tag, slot, position, stored, expected, chain - (1 << 64) if chain >= 1 << 63 else chain,
            aux - (1 << 64) if aux >= 1 << 63 else aux, bits]


def test_never_written_slot_names_no_writer_and_points_at_the_table():
    v = Violation.from_row(row(position=0, stored=0, expected=312, chain=0,
                               bits=int(FailReason.VERIFY_CHAIN_HASH | FailReason.VERIFY_POSITION)), 3,
                           reader_request=2, reader_position=4)
    text = v.block()
    assert v.never_written and "slot 9 was never written" in text and "request 0" not in text
    assert "read by request 2 at position 4" in text and "a missing KV write, or a wrong table" in text


@pytest.mark.parametrize("slot_position,expect", [
    (3, "position 4 went into position 3's slot"),
    (None, "expected position 5: the request's previous record (the slot its table gives position 3) holds "
           "position 4, not position 3"),
])
def test_write_row_says_which_position_went_where(slot_position, expect):
    v = Violation.from_row(row(tag=0, position=4, stored=7, expected=7, aux=5, bits=int(FailReason.WRITE_POSITION)),
                           6, writer_request=1, writer_step=6, slot_position=slot_position)
    text = v.block()
    assert "the engine wrote token 7 of position 4 into slot 9" in text and expect in text
    assert ("expected position 5" in text) == (slot_position is None)


def test_tail_row_rewritten_after_the_check_names_that_writer():
    v = Violation.from_row(row(tag=2, position=5, stored=405, expected=405, bits=int(FailReason.VERIFY_REAL_KV_HASH)),
                           2, reader_request=1, reader_position=5, writer_request=3, writer_step=2,
                           writer_token=406, writer_position=6)
    text = v.block()
    assert "last written by request 3 at step 2, with token 406 of position 6 (after this check)" in text
    assert "a write of position 6 landed in a slot still read as position 5" in text


def steady_builder() -> BatchBuilder:
    """A builder whose host_part runs on fake requests (no engine, no canary)."""
    from kvcanary.runtime.step.staging import Staging

    b = builder()
    ids: dict = {}
    b.s.ids = ids
    b.s.request_id = lambda name: ids.setdefault(name, len(ids) + 1)
    b.s.bp = SimpleNamespace(inputs_and_outputs=SimpleNamespace(requests_in_batch=[]))
    b.want_history = True
    b.stage = Staging(torch.device("cpu"))
    return b


@pytest.mark.parametrize("twist", [None, "short-history", "position-jump", "new-request", "new-state"])
def test_steady_decode_steps_stage_what_the_general_path_stages(twist):
    # decode steps of the same requests take the kept-array path (_steady); every step must stage
    # exactly what the general path stages for the same engine state, and anything unusual (a history
    # one token short, a position that jumps, a batch that changes) must leave it for the general path
    prompts = {"a": [10, 11, 12], "b": [20, 21], "c": [30, 31, 32, 33]}
    fast, general = steady_builder(), steady_builder()
    general._steady = lambda *a: None
    steady_calls = []
    orig = fast._steady
    fast._steady = lambda *a: steady_calls.append(orig(*a)) or steady_calls[-1]
    generated = {n: [] for n in prompts}
    offset = {n: len(p) for n, p in prompts.items()}  # the first decode step feeds the last prompt token
    states = {}
    for step in range(8):
        names = ["a", "b", "c"] + (["d"] if twist == "new-request" and step >= 5 else [])
        if "d" in names and "d" not in prompts:
            prompts["d"], generated["d"], offset["d"] = [40, 41], [], 2
        for n in names:
            generated[n].append(100 * step + ord(n))
        if twist == "position-jump" and step == 5:
            offset["c"] += 1  # c's position skips one (its row lacks a cell the general path then fills)
            generated["c"].insert(-1, 999)  # (its history holds the skipped position's token)
        staged = []
        for b in (fast, general):
            reqs = []
            for n in names:
                gen = generated[n][:-1] if twist == "short-history" and step == 5 and n == "b" else generated[n]
                # the engine keeps a request's state object and wraps it anew each step
                state = states.get((b is fast, n))
                if state is None or (twist == "new-state" and step == 4 and n == "a"):
                    state = states[b is fast, n] = SimpleNamespace(request_id=n, initial_tokens=prompts[n], status=0)
                state.generated_tokens, state.position_offset = list(gen), offset[n] + 1
                reqs.append(SimpleNamespace(state=state, query_length=1))
            b.s.bp.inputs_and_outputs.requests_in_batch = reqs
            h = b.host_part()
            staged.append((h.packed.tolist(), h.cells, h.width, h.total, list(h.prefix), list(h.extend)))
        assert staged[0] == staged[1], f"step {step}"
        for n in names:
            offset[n] += 1
    assert any(c is not None for c in steady_calls)  # the kept-array path ran
    if twist in ("short-history", "position-jump"):
        assert None in steady_calls[1:]  # ... and stepped aside for the twist
    if twist in ("new-request", "new-state"):
        assert len(steady_calls) < 7  # a step with another request or state object takes the general path
