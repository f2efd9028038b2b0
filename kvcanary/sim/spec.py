"""Speculative decoding: draft tokens, the target-verify forward's slots, accept/reject and rollback.

Drafts come from a cheap proposer (no draft-model KV, like n-gram speculation): each
draft equals the target's token with probability ``accept_prob`` (seeded per request
and position). The verify forward feeds the last sampled token plus the drafts
(prefix_len = seq_len, extend_len = draft_token_num). The target accepts the longest
run of drafts equal to its own tokens and adds one token of its own.

Slots: at page size 1 the verify writes in place, into the request's own next slots,
and rejected slots are freed. With larger pages it writes into scratch pages and the
accepted KV is moved into the request's pages (SGLang's ``move_kv_cache``), the move
reported to the canary with ``Canary.copy_records``.
"""

from __future__ import annotations

import torch

from kvcanary.format import splitmix64
from kvcanary.sim.request import Request


class Speculator:
    def __init__(self, cfg, pool, model, canary, bugs):
        self.k = cfg.spec_tokens
        self.accept_prob = cfg.accept_prob
        self.seed = cfg.seed
        self.vocab = cfg.vocab
        self.pool, self.model, self.canary, self.bugs = pool, model, canary, bugs
        self.in_place = cfg.page_size == 1
        self.proposed = 0
        self.accepted = 0

    def propose(self, req: Request, start: int) -> list[int]:
        """Draft tokens for positions start + 1 .. start + k (deterministic per seed, request, position)."""
        drafts = []
        for i in range(1, self.k + 1):
            p = start + i
            truth = req.truth(p)
            u = splitmix64((self.seed << 40) ^ (req.rid << 20) ^ p)
            if (u >> 11) / float(1 << 53) < self.accept_prob:
                drafts.append(truth)
            else:
                drafts.append((truth + 1 + (u % (self.vocab - 1))) % self.vocab)
        return drafts

    def verify_slots(self, req: Request, reserve) -> tuple[list[int], list[int]] | None:
        """(slots the verify writes, the request's own slots for those positions), or None without memory.

        ``reserve(req, n)`` extends the request by n positions (its own pages).
        """
        n = self.k + 1
        own = reserve(req, n)
        if own is None:
            return None
        if self.in_place:
            return own, own
        scratch = self.pool.alloc_run(n)
        if scratch is None:
            rejected = req.slots[req.kv_len - n:]
            del req.slots[req.kv_len - n:]
            self.pool.free_tail(rejected, req.kv_len)
            return None
        return scratch, own

    def commit(self, req: Request, start: int, drafts: list[int], written: list[int]) -> None:
        """Accept the longest correct run of drafts, add the target's token, roll the rest back."""
        accept = 0
        while accept < len(drafts) and drafts[accept] == self.model.sample(req.rid, start + 1 + accept):
            accept += 1
        self.proposed += len(drafts)
        self.accepted += accept
        req.tokens.extend(drafts[:accept] + [self.model.sample(req.rid, start + 1 + accept)])
        new_len = start + accept + 1
        if not self.in_place:
            src, dst = written[:accept + 1], req.slots[start:new_len]
            if not self.bugs.hit("spec_not_moved"):
                self._move(src, dst)
            self.pool.free(written)
        rejected = req.slots[new_len:]
        if not (rejected and self.in_place and self.bugs.hit("spec_keep_rejected")):
            del req.slots[new_len:]
        self.pool.free_tail(rejected, new_len)

    def _move(self, src: list[int], dst: list[int]) -> None:
        """Move KV bytes and canary records (full and SWA groups) from src to dst slots."""
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        swa_src, swa_dst = self.pool.swa_of(src), self.pool.swa_of(dst)
        self.model.move(src, dst, swa_src or None, swa_dst or None)
        self.canary.copy_records(t(src), t(dst))
        if swa_src:
            self.canary.copy_records(t(swa_src), t(swa_dst), group="swa")
