"""Continuous batching: arrivals, chunked prefill, decode (or verify), finish, abort, retraction.

One engine step forms one forward, in the order of an overlap scheduler:

1. ``schedule_decode``: every running request gets its next slot(s) (1 token, or the
   verify's 1 + drafts); when memory runs out even after prefix-cache eviction, the
   most recently admitted requests are retracted (KV dropped, requeued at the front).
2. ``process_results``: the previous forward's results are examined only now, after
   the decode batch was formed: finished requests and client aborts are released,
   but those already in the in-flight batch only after that forward completes.
3. ``schedule_prefill``: the chunked request continues, then waiting requests are
   admitted (prefix match, row, slots) while the token budget and memory allow.
4. the forward runs; ``complete`` samples, commits drafts, caches prefills, evicts
   SWA slots outside the window and runs the deferred releases.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvcanary.sim.request import Request, State


@dataclass
class Work:
    """One request's part of a forward."""

    req: Request
    kind: str  # "prefill" | "decode" | "verify"
    row: int
    start: int  # prefix_len
    slots: list[int]  # out_cache_loc
    input_ids: list[int]
    positions: list[int]
    drafts: list[int] = field(default_factory=list)
    final: bool = True  # prefill: the last chunk (samples a token)

    @property
    def n(self) -> int:
        return len(self.slots)


class Scheduler:
    def __init__(self, cfg, pool, tree, cache, model, spec, bugs):
        self.cfg = cfg
        self.pool, self.tree, self.cache, self.model, self.spec, self.bugs = pool, tree, cache, model, spec, bugs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.chunked: Request | None = None
        self.deferred: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.retractions = 0
        self.finished = 0
        self.aborted = 0
        self.failed = 0  # requests failed through the engine's error path (fail)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.deferred)

    def arrive(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.requests[r.rid] = r
            self.waiting.append(r)

    # -- memory ---------------------------------------------------------------------------------
    def _reserve(self, req: Request, n: int) -> list[int] | None:
        """Extend ``req`` by n own slots, evicting the prefix cache if needed."""
        if not self.cache.free_pages_for(self.pool.pages_needed(req.kv_len, n)):
            return None
        return self.pool.extend(req, n)

    def _decode_pages(self, req: Request) -> int:
        n = self.cfg.tokens_per_decode
        scratch = -(-n // self.pool.ps) if self.spec is not None and not self.spec.in_place else 0
        return self.pool.pages_needed(req.kv_len, n) + scratch

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.retract(req)
        req.state = State.WAITING
        self.waiting.appendleft(req)
        self.retractions += 1

    def preempt(self) -> bool:
        """Retract the most recently admitted decoding request now, as memory pressure would (kvcanary fuzz
        forces preemptions with it); False when fewer than two requests decode."""
        if len(self.running) < 2:
            return False
        self._retract(self.running[-1])
        return True

    # -- 1. decode ------------------------------------------------------------------------------
    def schedule_decode(self) -> list[Work]:
        reqs = list(self.running)
        # SGLang's check_decode_mem: retract (newest first) until the batch's pages can be found.
        while len(reqs) > 1 and (sum(self._decode_pages(r) for r in reqs)
                                 > self.pool.pages.free_pages + self.tree.evictable_pages()):
            self._retract_unless_done(reqs.pop())
        works = []
        for r in reqs:
            w = self._decode_work(r)
            if w is None:
                self._retract_unless_done(r)
            else:
                works.append(w)
        return works

    def _retract_unless_done(self, r: Request) -> None:
        """Retract ``r``, unless it has all its tokens (a re-prefill after a retraction samples one): then it
        only sits out this step's decode, and ``process_results`` finishes it (retracted again, it would be
        re-prefilled, sample past its ``max_new`` and never finish)."""
        if r.num_outputs < r.max_new:
            self._retract(r)

    def _decode_work(self, r: Request) -> Work | None:
        start = r.kv_len
        token = r.token_at(start)
        if r.token_at(start - 1) != token and self.bugs.hit("wrong_input_ids"):
            # Planted: the future-token map is read before this step's sampler wrote it.
            token = r.token_at(start - 1)
        if self.spec is None:
            slots = self._reserve(r, 1)
            if slots is None:
                return None
            after, ps = (r.slots[-2] + 1 if start > 0 else 0), self.pool.ps
            if self.bugs.on("write_into_free") and after // ps != slots[0] // ps \
                    and self.pool.pages.is_free(after // ps) and self.bugs.hit("write_into_free"):
                # Planted: the write slot assumes the request's pages are contiguous: the slot after its last one.
                slots = [after]
            return Work(r, "decode", r.row, start, slots, [token], [start])
        got = self.spec.verify_slots(r, self._reserve)
        if got is None:
            return None
        written, _ = got
        drafts = self.spec.propose(r, start)
        return Work(r, "verify", r.row, start, written, [token] + drafts,
                    list(range(start, start + len(written))), drafts)

    # -- 2. results of the previous forward -----------------------------------------------------
    def process_results(self, step: int, aborts: list[int], in_flight: set[int]) -> None:
        limit = self.cfg.max_context - self.cfg.tokens_per_decode - 2 * self.pool.ps
        for r in list(self.running):
            if r.num_outputs >= r.max_new or r.kv_len >= limit:
                self.running.remove(r)
                r.state = State.FINISHED
                r.done_step = step
                self.finished += 1
                self._release(r, in_flight, insert=True)
        for rid in aborts:
            r = self.requests.get(rid)
            if r is not None:
                self._abort(r, step, in_flight)

    def _release(self, r: Request, in_flight: set[int], insert: bool) -> None:
        if r.rid in in_flight and not self.bugs.hit("release_race"):
            self.deferred.append(r)
        else:
            # (Planted release_race: released at once while the in-flight forward still reads it.)
            self.cache.release(r, insert=insert)

    def _abort(self, r: Request, step: int, in_flight: set[int]) -> None:
        if r.released:
            # Already finished or aborted: nothing to do, unless the planted bug releases it again.
            if r.row and self.bugs.hit("double_free"):
                self.cache.release(r, insert=r.state is State.FINISHED)
            return
        self._stop(r, step, in_flight)
        self.aborted += 1

    def fail(self, r: Request, step: int, in_flight: set[int], error: str) -> bool:
        """The engine's error path for one request (the canary's mode "abort"): ended like a client abort,
        its KV released (after the in-flight forward if it is in it), no further output. False when it
        had ended already."""
        if r.released:
            return False
        r.error = error
        self._stop(r, step, in_flight)
        self.failed += 1
        return True

    def _stop(self, r: Request, step: int, in_flight: set[int]) -> None:
        if r.state is State.WAITING:
            self.waiting.remove(r)
            r.state, r.done_step = State.ABORTED, step
            return
        if r is self.chunked:
            self.chunked = None
        elif r in self.running:
            self.running.remove(r)
        r.state, r.done_step = State.ABORTED, step
        self._release(r, in_flight, insert=False)

    # -- 3. prefill -----------------------------------------------------------------------------
    def schedule_prefill(self) -> list[Work]:
        cfg = self.cfg
        budget = cfg.chunk_size or cfg.prefill_budget
        works: list[Work] = []
        if self.chunked is not None:
            r = self.chunked
            n = min(len(r.tokens) - r.kv_len, budget)
            w = self._prefill_work(r, n)
            if w is not None:
                works.append(w)
                budget -= n
        admitted = 0
        while self.waiting and budget > 0:
            if len(self.running) + (self.chunked is not None) + admitted >= cfg.max_running:
                break
            r = self.waiting[0]
            if not self.cache.admit(r):
                break
            extend = len(r.tokens) - r.kv_len
            n = extend
            if n > budget and (cfg.chunk_size == 0 and works or cfg.chunk_size and self.chunked is not None):
                self._undo_admit(r)
                break
            n = min(n, budget) if cfg.chunk_size else n
            headroom = sum(self._decode_pages(x) for x in self.running)
            need = self.pool.pages_needed(r.kv_len, n) + headroom
            w = None
            if need <= self.pool.pages.free_pages + self.tree.evictable_pages():
                w = self._prefill_work(r, n)
            if w is None:
                self._undo_admit(r)
                break
            self.waiting.popleft()
            r.state = State.PREFILL
            if n < extend:
                self.chunked = r
            works.append(w)
            budget -= n
            admitted += 1
        return works

    def _undo_admit(self, r: Request) -> None:
        self.cache.release(r, insert=False)
        r.reset_kv()

    def _prefill_work(self, r: Request, n: int) -> Work | None:
        start = r.kv_len
        slots = self._reserve(r, n)
        if slots is None:
            return None
        positions = list(range(start, start + n))
        if start > 0 and self.bugs.hit("wrong_positions"):
            # Planted: positions relative to the chunk, not the sequence.
            positions = list(range(n))
        ids = [r.token_at(p) for p in range(start, start + n)]
        return Work(r, "prefill", r.row, start, slots, ids, positions, final=start + n >= len(r.tokens))

    def finish_early(self, decode: list[Work]) -> None:
        """Planted ``early_free_unread`` (once): a request whose decode this step samples its last token has
        its own pages freed as the batch is formed, not after the forward that still reads and writes them."""
        if not self.bugs.on("early_free_unread") or self.bugs.first_step is not None:
            return
        for w in decode:
            r = w.req
            if r.num_outputs + 1 >= r.max_new and r.slots[r.cached_len:] and self.bugs.hit("early_free_unread"):
                self.pool.free(r.slots[r.cached_len:])
                return

    # -- 4. after the forward -------------------------------------------------------------------
    def complete(self, works: list[Work]) -> None:
        for w in works:
            r = w.req
            if r.freed or r.state is State.WAITING or r.error is not None:
                continue  # released, retracted or failed meanwhile: nothing of it is left to update
            if w.kind == "prefill":
                if w.final:
                    r.tokens.append(self.model.sample(r.rid, w.start + w.n))
                    if r.state is State.PREFILL:
                        r.state = State.RUNNING
                        self.running.append(r)
                    if self.chunked is r:
                        self.chunked = None
                self.cache.cache_unfinished(r)
            elif w.kind == "decode":
                r.tokens.append(self.model.sample(r.rid, w.start + 1))
            else:
                self.spec.commit(r, w.start, w.drafts, w.slots)
            if self.pool.window:
                self.pool.evict_window(r)
        deferred, self.deferred = self.deferred, []
        for r in deferred:
            self.cache.release(r, insert=r.state is State.FINISHED)
