"""Seeded workloads: shared prefixes, mixed lengths, bursts of arrivals and client aborts.

Everything derives from ``SimConfig.seed`` through one ``random.Random``, so a seed
names a workload exactly.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from kvcanary.sim.config import SimConfig
from kvcanary.sim.request import Request


@dataclass(frozen=True)
class RequestSpec:
    rid: int
    arrival: int
    prompt: tuple[int, ...]
    max_new: int
    abort_at: int | None


class Workload:
    """Requests of one run, indexed by the step they arrive at and the step they are aborted at."""

    def __init__(self, specs: list[RequestSpec], vocab: int):
        self.specs = specs
        self.vocab = vocab
        self._arrivals: dict[int, list[RequestSpec]] = defaultdict(list)
        self._aborts: dict[int, list[int]] = defaultdict(list)
        for s in specs:
            self._arrivals[s.arrival].append(s)
            if s.abort_at is not None:
                self._aborts[s.abort_at].append(s.rid)

    def arrivals(self, step: int) -> list[Request]:
        return [Request(s.rid, list(s.prompt), s.max_new, s.arrival, s.abort_at, self.vocab)
                for s in self._arrivals.get(step, ())]

    def aborts(self, step: int) -> list[int]:
        return list(self._aborts.get(step, ()))

    @property
    def last_arrival(self) -> int:
        return max((s.arrival for s in self.specs), default=0)


def make_workload(cfg: SimConfig) -> Workload:
    """The workload of ``cfg``: a few shared system prompts, unique suffixes, bursts and aborts.

    Lengths are kept so that prompt + outputs + one verify's drafts + a page fit in a row.
    """
    rng = random.Random(cfg.seed * 1_000_003 + 12_345)
    tok = lambda: rng.randrange(1, cfg.vocab)  # noqa: E731
    limit = cfg.max_context - cfg.tokens_per_decode - 2 * cfg.page_size - 2
    shared = [[tok() for _ in range(rng.randint(lo, hi))] for lo, hi in ((6, 14), (15, 30), (30, 48))]
    specs: list[RequestSpec] = []
    prompts: list[tuple[int, ...]] = []
    step = 1
    rid = 1
    while rid <= cfg.num_requests:
        burst = rng.choice((1, 1, 1, 2, 3, 4))
        # A burst is often a fan-out over one system prompt (parallel sampling, agents); the first one
        # always is, so requests compute a shared prefix together before the cache holds it.
        burst_prefix = rng.choice(shared) if rng.random() < 0.6 else None
        if rid == 1:
            burst, burst_prefix = 3, shared[1]
        for _ in range(min(burst, cfg.num_requests - rid + 1)):
            roll = rng.random()
            if rid <= 3:
                prompt = tuple(burst_prefix + [tok() for _ in range(rng.randint(1, 24))])
            elif rid == 5:
                prompt = tuple(tok() for _ in range(rng.randint(24, 40)))  # a one-off conversation ...
            elif rid == 4 or roll < 0.05 and prompts:
                # A near repeat (an edited or truncated earlier prompt): the match ends inside a cached node.
                base = prompts[0] if rid == 4 else rng.choice(prompts)
                cut = max(2 * cfg.page_size, len(base) // 2 + rng.randint(0, 3))
                prompt = tuple(base[:cut]) + tuple(tok() for _ in range(rng.randint(1, 24)))
            elif roll < 0.15 and prompts:
                prompt = rng.choice(prompts)  # an exact repeat: a full prefix-cache hit
            elif roll < 0.8:
                prefix = burst_prefix if burst_prefix is not None else rng.choice(shared)
                prompt = tuple(prefix + [tok() for _ in range(rng.randint(1, 24))])
            else:
                prompt = tuple(tok() for _ in range(rng.randint(2, 40)))
            max_new = rng.choice((rng.randint(1, 4), rng.randint(5, 16), rng.randint(17, 32)))
            prompt = prompt[:limit - 1]
            max_new = max(1, min(max_new, cfg.max_output, limit - len(prompt)))
            abort_at = None
            if rng.random() < 0.3:
                # Early (while queued or prefilling), mid-decode, or late (often after it finished).
                abort_at = step + rng.choice((rng.randint(0, 4), rng.randint(3, 14), rng.randint(12, 45)))
            if rid == 2:
                max_new, abort_at = min(2, max_new), step + 24  # its client disconnects after it finished
            elif rid == 3:
                max_new, abort_at = max(max_new, min(24, cfg.max_output)), step + 5  # ... while it decodes
            elif rid == 5:
                max_new, abort_at = min(max_new, 4), None
            elif rid == cfg.num_requests and rid > 5:
                prompt, abort_at = prompts[4], None  # ... that returns late, after memory pressure evicted it
                step += 8
            specs.append(RequestSpec(rid, step, prompt, max_new, abort_at))
            prompts.append(prompt)
            rid += 1
        step += rng.choice((1, 1, 2, 3, 5))
    return Workload(specs, cfg.vocab)
