"""The write and attention-metadata checks through the runtime's protocol (runtime/write_check.py,
runtime/attention_check.py, docs/write_check.md): a hand-driven engine of two layers names its cache rows, hands
each forward's computed K/V over, and its attention metadata; planted faults are reported, clean forwards are not."""

from __future__ import annotations

import pytest
import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolSpec
from kvcanary.format import FailReason
from kvcanary.runtime.batch import layer_sources

SLOTS, HEADS, DIM = 32, 2, 4


class Engine:
    """``layers`` layers (two by default) of K/V rows ``[slot, heads, dim]``; the canary fingerprints layer 0's K
    and the last layer's V."""

    def __init__(self, layers=2, **config):
        self.num_layers = layers
        self.keys = [torch.zeros(SLOTS, HEADS, DIM) for _ in range(layers)]
        self.values = [torch.zeros(SLOTS, HEADS, DIM) for _ in range(layers)]
        k_src, v_src = layer_sources(self.keys, self.values, check_v=False)
        self.canary = Canary(PoolSpec(SLOTS, k_src, v_src), CanaryConfig(mode="log", **config), max_batch=2,
                             max_tokens=8, max_context=16, num_rows=3)
        self.canary.write_check.name_layers([("full", list(range(layers)), self.keys, self.values)])
        self.table = torch.zeros(3, 16, dtype=torch.int64)

    def forward(self, prefix, tokens, slots, skip_v=(), mask=None):
        n = len(tokens)
        self.table[1, prefix:prefix + n] = torch.tensor(slots)
        batch = ForwardBatch(torch.tensor([1]), torch.tensor([prefix]), torch.tensor([n]), torch.tensor(tokens),
                             torch.arange(prefix, prefix + n), torch.tensor(slots), self.table)
        return self.run(batch, skip_v, mask)

    def run(self, batch, skip_v=(), mask=None):
        """One forward of ``batch`` (its table rows filled by the caller): every layer's K and V computed, noted and
        stored at ``out_cache_loc``, V skipped in the layers ``skip_v``; this forward's rows."""
        n, slots = batch.num_tokens, batch.out_cache_loc.tolist()
        prefix = int(batch.prefix_lens[0])
        c = self.canary
        seen = len(c.flush())
        c.before_forward(batch)
        if mask is not None:
            c.attention_check.check(cu_seqlens_k=torch.tensor([0, prefix + n]), mask=mask)
        for layer in range(self.num_layers):
            k, v = torch.randn(n, HEADS, DIM), torch.randn(n, HEADS, DIM)
            c.write_check.note_layer(layer, k, v)  # (what the layer computed, handed to its cache update)
            loc = torch.tensor(slots)
            self.keys[layer][loc] = k
            if layer not in skip_v:
                self.values[layer][loc] = v
        c.after_forward(batch)
        return c.flush()[seen:]  # (this forward's)


def test_a_clean_run_reports_nothing_and_the_hook_ran():
    e = Engine()
    e.forward(0, [11, 12, 13], [5, 6, 7])
    assert e.forward(3, [14], [8]) == []
    assert e.canary.stats()["write_check_notes"] == 4  # (two sources, two forwards)


def test_a_write_that_skips_v_is_reported_at_its_forward_with_layer_and_slot():
    e = Engine()
    e.forward(0, [11, 12, 13], [5, 6, 7])
    vs = e.forward(3, [14, 15], [8, 9], skip_v=(1,))
    assert [(v.step, v.slot, v.layer, v.source, v.reasons) for v in vs] == [
        (2, 8, 1, "V of layer 1 (full group)", ("write_kv",)), (2, 9, 1, "V of layer 1 (full group)", ("write_kv",))]
    assert vs[0].launch_tag == "TAIL_K_FULL" and vs[0].position == 3 and vs[0].stored_token == 14
    assert "K without V" in vs[0].block()


def test_a_layer_the_canary_does_not_fingerprint_is_not_compared():
    e = Engine()
    assert e.forward(0, [11, 12], [5, 6], skip_v=(0,)) == []  # (layer 0's V is no real-KV source)


def test_every_layer_with_write_check_layers_all():
    # a V write skipped in a middle layer only: no fingerprinted layer, so missed by default
    e = Engine(layers=5)
    e.forward(0, [11, 12], [5, 6])
    assert e.forward(2, [13], [7], skip_v=(2,)) == [] and len(e.canary.write_check.sources) == 2
    e = Engine(layers=5, write_check_layers="all")
    assert len(e.canary.write_check.sources) == 10  # (2 fingerprinted + the other 8 caches)
    assert e.forward(0, [11, 12], [5, 6]) == [] and e.canary.stats()["write_check_notes"] == 10
    vs = e.forward(2, [13, 14], [7, 8], skip_v=(2,))
    assert [(v.step, v.slot, v.position, v.layer, v.source, v.reasons) for v in vs] == [
        (2, 7, 2, 2, "V of layer 2 (full group)", ("write_kv",)), (2, 8, 3, 2, "V of layer 2 (full group)",
                                                                    ("write_kv",))]
    assert vs[0].launch_tag == "TAIL_V_FULL" and "K without V" in vs[0].block()
    # the next forward reads both slots: each read fails under its reader's name (the marked records)
    assert [(v.slot, v.reasons, v.readers, v.written_wrong) for v in e.forward(4, [15], [9])] == [
        (7, ("verify_real_kv_hash",), (1,), True), (8, ("verify_real_kv_hash",), (1,), True)]


def test_every_later_reader_of_a_wrong_write_is_named_until_the_slot_is_written_again():
    """A write that skipped V (slots 7, 8) is reported at its forward; the slots' records then certify no bytes:
    the writer's next forward and another request sharing the block (a prefix-cache hit) each fail
    verify_real_kv_hash under their own names, flagged as reading what that write left; a new write clears it."""
    e = Engine()
    e.forward(0, [11, 12], [5, 6])
    assert [(v.slot, v.reasons) for v in e.forward(2, [13, 14], [7, 8], skip_v=(1,))] == [
        (7, ("write_kv",)), (8, ("write_kv",))]
    e.table[2, :4] = e.table[1, :4]  # request 102 maps request 101's four positions
    e.table[1, 4], e.table[2, 4] = 9, 10
    t = torch.tensor
    both = ForwardBatch(t([1, 2]), t([4, 4]), t([1, 1]), t([15, 16]), t([4, 4]), t([9, 10]), e.table,
                        request_ids=t([101, 102]))
    vs = e.run(both)
    assert sorted({(v.slot, r) for v in vs for r in v.readers}) == [(7, 101), (7, 102), (8, 101), (8, 102)]
    assert sorted((v.slot, v.reader_request) for v in vs) == [(7, 101), (7, 102), (8, 101), (8, 102)]
    assert {(v.reasons, v.written_wrong) for v in vs} == {(("verify_real_kv_hash",), True)}
    assert "a victim of that write" in vs[0].block() and "the write check reported that write" in vs[0].block()
    # slot 7 written again (a new request at row 1, position 0): its record certifies the new bytes
    e.table[1].zero_()
    assert e.forward(0, [20], [7]) == []
    assert e.forward(1, [21], [11]) == []


def test_the_wrong_writes_remembered_are_the_newest_few(monkeypatch):
    """An engine that stores wrong bytes at every step would grow the remembered writes for as long as it serves:
    past the bound the oldest is forgotten. Its later reader is still reported (the record stays marked), without
    the flag; the newest write's reader keeps it."""
    from kvcanary.runtime import monitor

    monkeypatch.setattr(monitor, "KEEP_WRONG_WRITES", 1)
    e = Engine()
    e.forward(0, [11, 12], [5, 6])
    assert [v.slot for v in e.forward(2, [13], [7], skip_v=(1,))] == [7]
    # (the next forward reads slot 7, still remembered, and writes slot 8 wrong: slot 7's write is forgotten)
    assert [(v.slot, v.reasons, v.written_wrong) for v in e.forward(3, [14], [8], skip_v=(1,))] == [
        (7, ("verify_real_kv_hash",), True), (8, ("write_kv",), False)]
    assert len(e.canary.monitor.written_wrong) == 1
    assert [(v.slot, v.reasons, v.written_wrong) for v in e.forward(4, [15], [9])] == [
        (7, ("verify_real_kv_hash",), False), (8, ("verify_real_kv_hash",), True)]


def test_an_abandoned_forwards_notes_are_not_compared_with_the_next_forwards_writes():
    """The model raised after both layers noted their K/V: the forward is abandoned. Its retry takes a path whose
    hook sees layer 0's cache write only (layer 1's lands unseen, with other values): layer 1 is not compared
    with the abandoned forward's notes."""
    e = Engine()
    c = e.canary
    e.table[1, :2] = torch.tensor([5, 6])
    batch = ForwardBatch(torch.tensor([1]), torch.tensor([0]), torch.tensor([2]), torch.tensor([11, 12]),
                         torch.arange(2), torch.tensor([5, 6]), e.table)
    c.before_forward(batch)
    for layer in range(2):
        c.write_check.note_layer(layer, torch.randn(2, HEADS, DIM), torch.randn(2, HEADS, DIM))
    c.abandon_forward()  # (the model raised before any cache write)
    c.before_forward(batch)
    loc = torch.tensor([5, 6])
    k, v = torch.randn(2, HEADS, DIM), torch.randn(2, HEADS, DIM)
    c.write_check.note_layer(0, k, v)
    e.keys[0][loc], e.values[0][loc] = k, v
    e.keys[1][loc], e.values[1][loc] = torch.randn(2, HEADS, DIM), torch.randn(2, HEADS, DIM)
    c.after_forward(batch)
    assert c.flush() == [] and c.stats()["write_check_notes"] == 3


@pytest.mark.parametrize("skip", [None, 1, 2])
def test_one_model_forward_checked_as_two_canary_forwards_hands_each_its_own_notes(skip):
    """vLLM's waves: one model forward of two requests (tokens 0-1 request 1's, 2-3 request 2's) whose notes are
    taken in the model's token order, checked as a canary forward per request (request 2's first). ``restore``
    gives each its own tokens' notes: clean, nothing; token ``skip``'s V not stored, that slot alone, in the
    canary forward of its request."""
    e = Engine()
    c = e.canary
    slots = [5, 6, 9, 10]
    e.table[1, :2] = torch.tensor(slots[:2])
    e.table[2, :2] = torch.tensor(slots[2:])
    k, v = torch.randn(4, HEADS, DIM), torch.randn(4, HEADS, DIM)

    def part(r, tok):
        return ForwardBatch(torch.tensor([r]), torch.tensor([0]), torch.tensor([2]), torch.tensor([20 + r] * 2),
                            torch.arange(2), torch.tensor([slots[t] for t in tok]), e.table)

    waves = [(2, [2, 3]), (1, [0, 1])]
    c.before_forward(part(*waves[0]))
    for layer in range(2):  # the model forward: every token's K and V, noted, then stored
        c.write_check.note_layer(layer, k, v)
        e.keys[layer][torch.tensor(slots)] = k
        e.values[layer][torch.tensor(slots)] = v
        if skip is not None:
            e.values[layer][slots[skip]] = 0.0
    saved = c.write_check.save()
    found = []
    for i, (r, tok) in enumerate(waves):
        if i:
            c.before_forward(part(r, tok))
        c.write_check.restore(saved, torch.tensor(tok))
        c.after_forward(part(r, tok))
        rows = c.flush()[sum(map(len, found)):]  # (flush returns every row so far)
        found.append([(v.slot, v.writer_request, v.reasons) for v in rows])
    if skip is None:
        assert found == [[], []]
    else:
        want = [(slots[skip], None, ("write_kv",))]
        assert found == ([[], want] if skip < 2 else [want, []])
    assert c.write_check.save() is None  # (nothing noted since the last comparison)


def test_write_check_layers_all_refuses_a_layer_laid_out_unlike_its_group():
    e = Engine(layers=3, write_check_layers="all")
    with pytest.raises(ValueError, match="layer 1's K rows in group 'full' laid out like"):
        e.canary.write_check.name_layers([("full", [0, 1, 2], [e.keys[0], torch.zeros(SLOTS, DIM, HEADS),
                                                                e.keys[2]], e.values)])


def test_off_the_write_check_sees_nothing():
    e = Engine(write_check=False)
    assert e.forward(0, [11, 12], [5, 6], skip_v=(1,)) == [] and e.canary.stats()["write_check_notes"] == 0


def _causal(prefix: int, n: int, width: int) -> torch.Tensor:
    """The additive mask of one request's ``n`` queries over ``width`` key columns (its ``prefix + n`` keys first)."""
    mask = torch.full((n, width), torch.finfo(torch.float32).min)
    for i in range(n):
        mask[i, :prefix + i + 1] = 0
    return mask


def test_a_mask_that_shows_a_query_a_key_it_may_not_read_or_hides_its_own_is_reported():
    e = Engine()
    e.forward(0, [11, 12], [5, 6])
    assert e.forward(2, [13, 14], [7, 8], mask=_causal(2, 2, 6)) == []  # (two padding columns, hidden)
    future = _causal(4, 2, 8)
    future[0, 5] = 0  # the query at position 4 may attend position 5's key: not in its read index yet
    vs = e.forward(4, [15, 16], [9, 10], mask=future)
    assert [v.reasons for v in vs] == [("attention_mask",)] and vs[0].reader_request == 1
    assert (vs[0].position, vs[0].stored_token, vs[0].expected_token) == (4, 1, 0)
    assert "may attend key column 5" in vs[0].block()
    hidden = _causal(6, 1, 8)
    hidden[0, 2] = torch.finfo(torch.float32).min  # its own position 2 hidden
    vs = e.forward(6, [17], [11], mask=hidden)
    assert [(v.position, v.stored_token, v.expected_token) for v in vs] == [(6, 0, 1)]
    assert "may not attend key column 2" in vs[0].block()


def test_bad_input_is_refused_before_anything_is_noted():
    e = Engine()
    src = e.canary.write_check.sources[0]
    with pytest.raises(ValueError, match="one of the canary's real-KV sources"):
        e.canary.write_check.note(layer_sources([torch.zeros(4, 8)], [torch.zeros(4, 8)], False)[0][0],
                                  torch.zeros(1, 8))
    with pytest.raises(ValueError, match="bytes per row"):
        e.canary.write_check.note(src, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="one K and one V tensor per layer"):
        e.canary.write_check.name_layers([("full", [0], e.keys, e.values)])
    assert int(e.canary.write_check.noted.sum()) == 0 and FailReason.WRITE_KV == 1024
