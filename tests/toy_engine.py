"""A minimal paged-KV engine with hand-made tables, for runtime tests.

It keeps a req_to_token table, a free list of slots (slot 0 reserved), a K (and V)
cache tensor per pool, and runs "forwards" that write deterministic KV bytes per
(token, position). Tests plant bugs by editing its tables or KV directly.
"""

from __future__ import annotations

import torch

from kvcanary import Canary, CanaryConfig, ForwardBatch, PoolSpec, RealKvSource, SwaSpec, TokenAppend, TokenHistory
from kvcanary.format import oracle_token

DIM = 8  # float32 values per token: 32 bytes of K per slot


class ToyEngine:
    def __init__(self, num_slots=64, num_rows=8, max_context=32, max_batch=4, max_tokens=64, swa_window=0,
                 swa_slots=0, device="cpu", token_history=False, oracle=False, **config):
        self.device = torch.device(device)
        self.k = torch.zeros(num_slots, 1, DIM, device=self.device)
        self.v = torch.zeros(num_slots, 1, DIM, device=self.device)
        src = lambda t: RealKvSource(t, page_size=1, num_bytes_per_token=DIM * 4, read_bytes=DIM * 4)  # noqa: E731
        swa = None
        if swa_window:
            self.full_to_swa = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
            self.swa_k = torch.zeros(swa_slots, 1, DIM, device=self.device)
            self.swa_v = torch.zeros(swa_slots, 1, DIM, device=self.device)
            self.swa_free = list(range(1, swa_slots))
            swa = SwaSpec(swa_slots, swa_window, self.full_to_swa, (src(self.swa_k),), (src(self.swa_v),))
        self.window = swa_window
        pool = PoolSpec(num_slots, (src(self.k),), (src(self.v),), swa=swa)
        config.setdefault("backend", "torch")
        self.canary = Canary(pool, CanaryConfig(**config), max_batch=max_batch, max_tokens=max_tokens,
                             max_context=max_context, num_rows=num_rows, device=self.device)
        self.rtt = torch.zeros(num_rows, max_context, dtype=torch.int32, device=self.device)
        self.free = list(range(1, num_slots))
        self.free_rows = list(range(1, num_rows))
        self.reqs: dict[int, dict] = {}
        self.token_history, self.oracle = token_history, oracle
        self.sent: dict[int, int] = {}  # token_history='append': tokens sent per request

    def add(self, rid: int, prompt: list[int], share_from: int | None = None, shared: int = 0) -> None:
        """New request; optionally its first `shared` positions map onto request share_from's slots."""
        row = self.free_rows.pop(0)
        self.reqs[rid] = {"row": row, "tokens": list(prompt), "cached": 0}
        if share_from is not None:
            src = self.reqs[share_from]
            self.rtt[row, :shared] = self.rtt[src["row"], :shared]
            self.reqs[rid]["cached"] = shared

    def kv_value(self, token: int, position: int) -> torch.Tensor:
        return torch.arange(DIM, dtype=torch.float32, device=self.device) * 0.5 + token * 3 + position * 0.25

    def forward(self, schedule: list[tuple[int, int]], corrupt=None, feed=None) -> ForwardBatch:
        """One forward: each (rid, n) extends request rid by n of its known tokens (decode appends oracle tokens)."""
        rows, prefix, extend, ids, pos, locs, rids, hist = [], [], [], [], [], [], [], []
        for rid, n in schedule:
            r = self.reqs[rid]
            P = r["cached"]
            while len(r["tokens"]) < P + n:
                r["tokens"].append(oracle_token(rid, len(r["tokens"]), 1000))
            new = [self.free.pop(0) for _ in range(n)]
            self.rtt[r["row"], P:P + n] = torch.tensor(new, dtype=torch.int32)
            if self.window:
                for s in new:
                    self.full_to_swa[s] = self.swa_free.pop(0)
            rows.append(r["row"]), prefix.append(P), extend.append(n), rids.append(rid)
            ids += r["tokens"][P:P + n]
            pos += list(range(P, P + n))
            locs += new
            hist.append(r["tokens"][:P + n])
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        history = None
        if self.token_history == "append":
            # Rows are stable here: send each request's tokens once, as table cells.
            cells = [[], [], []]
            for row, rid, h in zip(rows, rids, hist):
                have = self.sent.get(rid, 0)
                cells[0] += [row] * (len(h) - have)
                cells[1] += range(have, len(h))
                cells[2] += h[have:]
                self.sent[rid] = len(h)
            history = TokenAppend(t(cells[0]), t(cells[1]), t(cells[2]), t([len(h) for h in hist]))
        elif self.token_history:
            offs = [0]
            for h in hist:
                offs.append(offs[-1] + len(h))
            history = TokenHistory(t([x for h in hist for x in h]), t(offs))
        batch = ForwardBatch(t(rows), t(prefix), t(extend), t(ids), t(pos), t(locs), self.rtt, request_ids=t(rids),
                             token_history=history)
        if self.oracle:
            batch.expected_input_ids = batch.input_ids.clone()
            batch.expected_positions = batch.positions.clone()
        if feed is not None:
            feed(batch)
        self.canary.before_forward(batch)
        for tok, p, s in zip(batch.input_ids.tolist(), batch.positions.tolist(), locs):
            self.k[s, 0] = self.kv_value(tok, p)
            self.v[s, 0] = -self.kv_value(tok, p)
            if self.window:
                self.swa_k[int(self.full_to_swa[s]), 0] = self.kv_value(tok, p)
                self.swa_v[int(self.full_to_swa[s]), 0] = -self.kv_value(tok, p)
        if corrupt is not None:
            corrupt(self)
        self.canary.after_forward(batch)
        for rid, n in schedule:
            self.reqs[rid]["cached"] += n
        return batch

    def slot(self, rid: int, position: int) -> int:
        return int(self.rtt[self.reqs[rid]["row"], position])
