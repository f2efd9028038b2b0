"""The bug registry: every planted bug of the zoo, its BUGS.md class, where it applies, what it does.

A run plants at most one bug (``SimConfig.bug``). The engine asks its ``BugSwitch``
at the exact line the mistake would be: ``if ... and self.bugs.hit("double_free")``.
``hit`` is True only for the planted bug and records the first step the mistake took
effect (the "planted" step the zoo compares the first detection with).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config imports this module to check SimConfig.bug; the hint alone needs no import
    from kvcanary.sim.config import SimConfig


@dataclass(frozen=True)
class Bug:
    """One planted bug.

    Attributes:
        name: registry key (``SimConfig(bug=name)``).
        cls: BUGS.md class letter (A lifetime ... I speculative decoding).
        summary: the mistake in one line.
        mechanism: how it corrupts what attention reads.
        expect: what the canary reports.
        needs: the configurations where the mistake can occur.
        needs_text: ``needs`` in words.
    """

    name: str
    cls: str
    summary: str
    mechanism: str
    expect: str
    needs: Callable[[SimConfig], bool] = lambda cfg: True
    needs_text: str = "any"

    def applies(self, cfg: SimConfig) -> bool:
        return self.needs(cfg)


def _paged(cfg: SimConfig) -> bool:
    return cfg.page_size > 1


_BUG_LIST = (
    Bug("double_free", "A", "an abort arriving after the request finished releases it a second time",
        "the abort handler has no already-released guard: the row and the request's unshared pages go back to "
        "the free lists twice, and two later requests are handed the same row or page",
        "SharedRowError at HEAD when both owners of the row meet in one forward; HEAD verify_token (with "
        "chain/position) where two owners share a page"),
    Bug("free_while_cached", "A", "abort frees every slot of the request, including those the prefix cache holds",
        "the pages of the matched prefix and of inserted prefill chunks go back to the allocator while the radix "
        "tree still maps them; a new request overwrites them and every later hit reads foreign KV (SGLang #38319)",
        "TAIL verify_real_kv_hash in the forward that rewrites the freed pages while a prefix hit reads them; "
        "then chain/position at HEAD and SWEEP"),
    Bug("early_free_unread", "A", "a request's own pages are freed when its last decode is scheduled, before "
        "the forward that reads them",
        "the finish is predicted from max_new as the batch is formed: the pages go back to the free list while the "
        "request's table maps them and its forward still reads and writes them; nobody reuses them before the "
        "step ends, so no read sees foreign KV yet",
        "ALLOCATOR live_block_free (and free_block_write) at the step's close, naming the block, the request and "
        "the step of the free; read-time checks only once a later owner rewrites the pages"),
    Bug("release_race", "A", "a finished or aborted request is released while the in-flight forward still reads it",
        "with the overlap scheduler the request is already in the next batch; its row and slots go back at once, "
        "a request admitted into that same batch takes them, and the forward reads the new owner's table "
        "(SGLang PR #18803)",
        "SharedRowError at HEAD: the in-flight forward holds the old and the new owner of one row"),
    Bug("insert_dup_stale_table", "A", "inserting a prefix that already exists frees the duplicate pages but "
        "leaves the request's table pointing at them",
        "two requests computed the same prefix in one batch; the second insert frees its own copies, the table "
        "row is not rewritten to the tree's slots, and the freed pages are reused",
        "TAIL verify_real_kv_hash when the freed duplicates are rewritten (or HEAD write_position), then "
        "chain/token at HEAD",
        lambda cfg: cfg.chunk_size == 0, "no chunked prefill"),
    Bug("stale_table_tail", "C", "a new page's table cells are written only up to the request's length",
        "the rest of the page keeps the row's previous occupant's slot ids; the next decode in that page takes "
        "its slot from the stale cell and writes into a page it does not own (SGLang PR #35401)",
        "TAIL verify_real_kv_hash or HEAD chain+position+token when the stale slot's owner next reads it",
        _paged, "page_size > 1"),
    Bug("swa_no_translation", "D", "the sliding-window layer writes KV at full-pool slot ids, untranslated",
        "the SWA cache is indexed with out_cache_loc instead of full_to_swa[out_cache_loc]: the token's own SWA "
        "slot keeps old bytes and another token's SWA slot is overwritten (SGLang PRs #24617, #26531)",
        "TAIL_K_SWA write_kv in the very forward (the token's own SWA slot holds other bytes than the layer computed); "
        "TAIL_K_SWA verify_real_kv_hash at the overwritten SWA slot's next reader",
        lambda cfg: cfg.swa_window > 0, "SWA on"),
    Bug("write_into_free", "C", "a decode's write slot assumes the request's pages are contiguous: the slot "
        "after its last one",
        "at a page edge the new token's KV and record go to the next page's first slot, a free page, while the "
        "request's table maps the page it was given; the token's own slot stays unwritten",
        "ALLOCATOR free_block_write at the step's close; HEAD verify (never written) in the next forward",
        lambda cfg: cfg.spec_tokens == 0, "no spec"),
    Bug("wrong_positions", "D", "extend positions are chunk-relative: arange(extend_len) without the prefix length",
        "after a prefix hit or a first chunk, the model is fed positions 0..n-1 instead of P..P+n-1",
        "HEAD write_position (write-input and chain-position asserts) in the very forward"),
    Bug("page_edge", "E", "the end of the last reserved page is computed as (len // page + 1) * page",
        "exactly on a page edge the next, unreserved page counts as reserved: its cells are read as slots "
        "(the previous occupant's), and KV is written into pages the request does not own (SGLang #22819)",
        "TAIL verify_real_kv_hash or HEAD chain+position+token when the pages' owners read them",
        _paged, "page_size > 1"),
    Bug("window_edge", "E", "window eviction frees one SWA slot too many: the window's first position",
        "the free covers [evicted, P - W] while translations are cleared for [evicted, P - W): the edge "
        "position keeps a live translation into a slot the SWA pool hands to another token (SGLang PR #34273)",
        "TAIL_K_SWA verify_real_kv_hash or SWEEP_K_SWA verify_position once the slot is reused",
        lambda cfg: cfg.swa_window > 0, "SWA on"),
    Bug("match_too_long", "E", "the radix key match counts the first differing page as matching",
        "a request takes one page (one token at page size 1) of another sequence's KV as its cached prefix",
        "HEAD verify_token in the request's first forward"),
    Bug("loadback_wrong_slots", "G", "load-back copies host KV into the node's old device slots",
        "records are restored into the newly allocated slots, but the bytes land in the slots the node had before "
        "offload, now owned by others",
        "TAIL verify_real_kv_hash in the forward reading the loaded prefix",
        lambda cfg: cfg.offload, "offload on"),
    Bug("loadback_partial", "G", "a short host-to-device transfer is taken as complete",
        "only the first half of a loaded node's tokens arrives; the rest keeps the bytes of the slots' previous "
        "owners (LMCache #4991-style partial read)",
        "TAIL verify_real_kv_hash in the forward reading the loaded prefix",
        lambda cfg: cfg.offload, "offload on"),
    Bug("loadback_no_wait", "B", "the forward does not wait for the load-back copy's event",
        "the H2D copy runs on a side stream and lands after the forward that reads the loaded prefix "
        "(SGLang HiCache load-back)",
        "TAIL verify_real_kv_hash in that forward",
        lambda cfg: cfg.offload, "offload on"),
    Bug("offload_free_before_copy", "B", "device pages are freed before the offload (D2H) copy reading them ran",
        "the pages are reused and rewritten by the same step's forward; the host copy captures the new owner's "
        "KV and a later load-back brings it back under the old records (vLLM #45704)",
        "TAIL verify_real_kv_hash in the forward after the load-back",
        lambda cfg: cfg.offload, "offload on"),
    Bug("padding_write", "H", "CUDA-graph padding tokens keep the static buffer's stale out_cache_loc",
        "padded decode batches reuse the previous replay's slot ids instead of slot 0, so padding tokens write "
        "garbage KV into real slots (SGLang PR #32477)",
        "TAIL verify_real_kv_hash in the next forward reading the slot (or SWEEP if it is cached)",
        lambda cfg: not (cfg.spec_tokens and cfg.page_size > 1),
        "not spec with page_size > 1"),
    Bug("spec_keep_rejected", "I", "after a partial accept, rejected draft slots stay in the request's table",
        "the rollback frees the rejected drafts' slots but leaves them in the request's slot list and row: the "
        "next forward reads them as its prefix (SGLang PR #8409)",
        "HEAD verify_token in the next forward, then write_token/write_position and chain",
        lambda cfg: cfg.spec_tokens > 0 and cfg.page_size == 1, "spec, page_size 1"),
    Bug("spec_not_moved", "I", "accepted draft KV is not moved from the verify's scratch pages",
        "with page_size > 1 the verify writes drafts into scratch pages and accepted KV must be moved into the "
        "request's pages (move_kv_cache); the move is skipped and the request's pages hold stale KV "
        "(SGLang PR #26982)",
        "HEAD verify_chain_hash+verify_position+verify_token in the next forward",
        lambda cfg: cfg.spec_tokens > 0 and cfg.page_size > 1, "spec, page_size > 1"),
    Bug("nan_write", "H", "one layer's K of a decode token is written as NaN (an overflow in that layer)",
        "the forward writes a NaN pattern into layer 1's K of the first decoding request's new token; the records "
        "are right, and every later token that attends to it inherits the NaN",
        "TAIL nonfinite_kv in the very forward, naming the layer's source, the request and the position; write_kv "
        "there too (the NaN is not what the layer computed)"),
    Bug("read_slot0", "C", "a rollback clears one table cell too many: a live prefix cell becomes slot 0",
        "the cell of a decoding request's middle prefix position is zeroed (the padding slot) while the request "
        "still reads it; the verify op skips slot 0 and the next position's chain check, whose predecessor is "
        "0, so the record checks alone see nothing",
        "HEAD reserved_slot_read in every forward that reads the cell"),
    Bug("read_partial_tail", "E", "a decode's key length is taken from its allocated pages, not its length",
        "seq_len is rounded up to the end of the last page: the forward reads the page's unused tail as live "
        "(cells no token of the request wrote: the page's previous occupant's KV, or never-written slots)",
        "HEAD verify_position (with chain/token: the tail's foreign or empty records), write_position",
        lambda cfg: cfg.page_size > 1 and not cfg.spec_tokens, "page_size > 1, no spec"),
    Bug("wrong_input_ids", "B", "the decode input is read from the future-token map before the sampler wrote it",
        "with the overlap scheduler the decode input is the previous step's token, not the one just sampled",
        "HEAD write_token (write-input assert) in the very forward, then verify_token"),
)

BUGS: dict[str, Bug] = {b.name: b for b in _BUG_LIST}


class BugSwitch:
    """The run's planted bug (or none).

    ``hit(name)``: is ``name`` planted? If so the mistake takes effect now (recorded). Bugs whose mistake
    is sometimes harmless (a copy to slots that already hold the same bytes) ask ``on(name)`` and call
    ``took_effect(name)`` only when it corrupts KV, so "planted" means "corrupted something".
    """

    def __init__(self, name: str | None):
        if name is not None and name not in BUGS:
            raise ValueError(f"kv-canary: bug must be one of {sorted(BUGS)}, got {name!r}")
        self.name = name
        self.step = 0  # the engine's current forward step (1-based)
        self.first_step: int | None = None
        self.hits = 0

    def on(self, name: str) -> bool:
        """True when ``name`` is the planted bug (nothing recorded)."""
        return name == self.name

    def took_effect(self, name: str) -> None:
        if name == self.name:
            self.hits += 1
            if self.first_step is None:
                self.first_step = self.step

    def hit(self, name: str) -> bool:
        """True when ``name`` is the planted bug (the caller then takes the buggy path, which corrupts KV)."""
        if name != self.name:
            return False
        self.took_effect(name)
        return True
