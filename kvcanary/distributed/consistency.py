"""Cross-rank consistency of tensor-parallel canaries (one ``Canary`` per rank).

Tensor-parallel ranks share one scheduler decision per step: the same batch, the same
slots, the same table. Each rank's canary fingerprints only its own shard of the KV
heads, so its real-KV hashes differ from the other ranks', but everything else must
agree: launches and entries per launch tag, tokens protected, which slots hold which
(token, position, prev_hash) record, and the set of violations found. Every
``interval`` steps (and at ``finish``) each rank reduces that state to a short int64
vector; one ``all_gather`` gives every rank every vector, and the ranks that disagree
with the majority are named (with two ranks there is no majority: the reference is
rank 0, the rank whose scheduler a TP engine usually broadcasts from).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvcanary.format import MASK64, LaunchTag, RecordField as R, mix3, to_signed
from kvcanary.ops.torch_hash import splitmix64 as t_splitmix64

log = logging.getLogger("kvcanary")

# Steps a CUDA canary's drained violations may lag behind its step (the observer's snapshots in flight + 1).
SETTLE_STEPS = 4
# Default steps between exchanges: one small all_gather and a pass over the TAIL K buffers every 16 forwards.
DEFAULT_INTERVAL = 16
# Odd 64-bit multipliers (as int64) of the record digest: token, position, prev_hash; and the slot's.
_FIELD_MULTS = (to_signed(0x9E3779B97F4A7C15), to_signed(0xC2B2AE3D27D4EB4F), to_signed(0x165667B19E3779F9))
_SLOT_MULT = to_signed(0xD6E8FEB86659FD93)


class KvCanaryDivergenceError(RuntimeError):
    """Raised on every rank in mode "raise" when ranks disagree."""


@dataclass(frozen=True)
class Divergence:
    """One rank whose canary state differs from the reference at an exchange.

    Attributes:
        step: the exchange's forward step.
        rank: the rank that differs.
        fields: names of the differing fields (e.g. "records:full", "violations", "launches:TAIL_K_FULL").
        reference: how the reference was chosen ("majority of 3" or "rank 0").
    """

    step: int
    rank: int
    fields: tuple[str, ...]
    reference: str

    def log_line(self) -> str:
        return (f"kv_canary divergence: rank={self.rank} step={self.step} fields={','.join(self.fields)} "
                f"reference={self.reference}")

    def to_dict(self) -> dict:
        return {"step": self.step, "rank": self.rank, "fields": list(self.fields), "reference": self.reference}


def record_digest(buf: torch.Tensor) -> torch.Tensor:
    """int64 [1] order-independent digest of (slot, token, position, prev_hash) over a canary buffer.

    The real-KV hash (field 3) and the writer fields stay out: they differ between ranks by design.
    """
    w = buf.view(torch.int64)
    slot = torch.arange(w.shape[0], dtype=torch.int64, device=w.device)
    # One odd multiplier per field, then one splitmix64 per slot: about a dozen passes over [num_slots] (a full
    # mix3 per field costs three times that); a moved or changed record changes its slot's term.
    mult = torch.tensor(_FIELD_MULTS, dtype=torch.int64, device=w.device)
    lin = (w[:, R.TOKEN:R.PREV_HASH + 1] * mult).sum(dim=1) + slot * _SLOT_MULT
    return t_splitmix64(lin).sum(dtype=torch.int64).reshape(1)


def violation_digest(violations) -> int:
    """Order-independent digest of violations (step, tag, slot, position, tokens, chain hashes, reasons)."""
    acc = 0
    for v in violations:
        h = mix3(v.step, hash_text(v.launch_tag), v.slot)
        h = mix3(h, v.position, v.stored_token & MASK64)
        h = mix3(h, v.expected_token & MASK64, v.stored_chain_hash)
        acc = (acc + mix3(h, v.expected_aux, v.fail_reason)) & MASK64
    return to_signed(acc)


def hash_text(s: str) -> int:
    acc = 0
    for b in s.encode():
        acc = mix3(acc, b, 0)
    return acc


def compare(rows: list[list[int]], names: list[str], step: int) -> list[Divergence]:
    """Ranks whose row differs from the reference, field by field (rows[r] is rank r's vector).

    The reference value of a field is the one most ranks hold; on a tie, the one of the lowest
    rank among the tied values.
    """
    world = len(rows)
    diff: dict[int, list[str]] = {}
    tie_rank = None
    for j, name in enumerate(names):
        values = [row[j] for row in rows]
        counts = Counter(values)
        top = max(counts.values())
        ref = next(x for x in values if counts[x] == top)
        if list(counts.values()).count(top) > 1:
            tie_rank = values.index(ref) if tie_rank is None else min(tie_rank, values.index(ref))
        for r, x in enumerate(values):
            if x != ref:
                diff.setdefault(r, []).append(name)
    reference = f"majority of {world}" if tie_rank is None else f"rank {tie_rank} (no majority of {world})"
    return [Divergence(step, r, tuple(f), reference) for r, f in sorted(diff.items())]


class ConsistencyCheck:
    """The cross-rank consistency step of one TP rank's canary.

    Args:
        canary: this rank's ``Canary``.
        interval: forwards between exchanges (0 = only at ``finish``).
        group: the TP process group (default: the default group).
        device: where the exchanged vector lives (the rank's GPU with NCCL; default the canary's device).

    Every rank calls ``step()`` after each ``after_forward`` and ``finish()`` at the end (both are
    collective on the exchange steps). Divergences are logged on rank 0, kept in ``divergences``
    on every rank (each (rank, field) once), and raised in mode "raise".

    Example:
        >>> check = ConsistencyCheck(canary)
        >>> canary.after_forward(batch); check.step()
    """

    def __init__(self, canary, *, interval: int = DEFAULT_INTERVAL, group=None, device=None):
        if not isinstance(interval, int) or interval < 0:
            raise ValueError(f"kv-canary: ConsistencyCheck interval must be an int >= 0, got {interval!r}")
        self.canary = canary
        self.interval = interval
        self.group = group
        self.device = torch.device(device) if device is not None else canary.device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.steps = 0
        self.exchanges = 0
        self.seconds: list[float] = []  # wall time of each exchange (digest + all_gather + compare)
        self.local_seconds: list[float] = []  # its local part: the vector and its digests, before the all_gather
        self.divergences: list[Divergence] = []
        self._seen: set[tuple[int, str]] = set()
        self._folded = (0, 0)  # (violations folded into the digest so far, their digest): each is hashed once

    def field_names(self) -> list[str]:
        names = ["step", "forwards", "tokens", "violations", "violation_digest"]
        names += [f"{what}:{t.name}" for t in LaunchTag for what in ("launches", "entries")]
        return names + [f"records:{g.name}" for g in self.canary.groups]

    def local_vector(self, settled: int | None) -> torch.Tensor:
        """This rank's int64 vector (violations counted up to step ``settled``; None = all drained)."""
        c, m = self.canary, self.canary.monitor
        n, acc = self._folded
        # Drains append violations in step order, so the settled ones are a growing prefix of the list.
        end = n
        while end < len(m.violations) and (settled is None or m.violations[end].step <= settled):
            end += 1
        acc = to_signed((acc + violation_digest(m.violations[n:end])) & MASK64)
        self._folded = (end, acc)
        host = torch.tensor([c.step, m.forwards, m.tokens, end, acc], dtype=torch.int64)
        parts = [host.to(self.device), c.counters.reshape(-1).to(self.device)]
        parts += [record_digest(g.bufs["tail", "k"]).to(self.device) for g in c.groups]
        return torch.cat(parts)

    def step(self) -> list[Divergence]:
        """Count a forward; on every ``interval``-th, exchange. Returns the new divergences."""
        self.steps += 1
        if not self.interval or self.steps % self.interval:
            return []
        return self.exchange(settled=self.canary.step - SETTLE_STEPS)

    def finish(self) -> list[Divergence]:
        """Flush the canary and exchange once more over everything (collective: every rank enters the exchange,
        also one whose flush raised, mode raise's violations that rank alone found; its error follows)."""
        try:
            self.canary.flush()
        except Exception:
            self.exchange(settled=None)  # (else the other ranks wait in it for this one for ever)
            raise
        return self.exchange(settled=None)

    def exchange(self, settled: int | None) -> list[Divergence]:
        t0 = time.perf_counter()
        mine = self.local_vector(settled)
        if mine.device.type == "cuda":
            torch.cuda.synchronize(mine.device)
        self.local_seconds.append(time.perf_counter() - t0)
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.group)
        rows = torch.stack(gathered).cpu().tolist()
        self.seconds.append(time.perf_counter() - t0)
        self.exchanges += 1
        fresh = []
        for d in compare(rows, self.field_names(), self.canary.step):
            new = tuple(f for f in d.fields if (d.rank, f) not in self._seen)
            if new:
                self._seen.update((d.rank, f) for f in new)
                fresh.append(Divergence(d.step, d.rank, new, d.reference))
        self.divergences.extend(fresh)
        if fresh and self.rank == 0:
            for d in fresh:
                log.warning(d.log_line())
        if fresh and self.canary.config.mode == "raise":
            raise KvCanaryDivergenceError("kv-canary: ranks diverged\n" + "\n".join(d.log_line() for d in fresh))
        return fresh

    def cost(self) -> dict:
        """Exchanges run; mean seconds per exchange (whole, and its local part without the all_gather, which
        also waits for the slowest rank); the whole spread over the forwards (seconds per step)."""
        total, n = sum(self.seconds), self.exchanges
        return {"exchanges": n, "interval": self.interval, "mean_exchange_s": total / n if n else 0.0,
                "mean_local_s": sum(self.local_seconds) / n if n else 0.0,
                "per_step_s": total / self.steps if self.steps else 0.0}
