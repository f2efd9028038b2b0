"""Violation reports of several ranks, gathered on one rank with the rank in every row."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from kvcanary.runtime.report import Violation


@dataclass(frozen=True)
class RankedViolation:
    """A ``Violation`` found on ``rank`` (of ``instance``: "tp", "prefill", "decode", ...)."""

    rank: int
    instance: str
    violation: Violation

    def log_line(self) -> str:
        rest = self.violation.log_line().removeprefix("kv_canary violation: ")
        return f"kv_canary violation: rank={self.rank} instance={self.instance} {rest}"

    def block(self) -> str:
        return f"[rank {self.rank} ({self.instance})] " + self.violation.block()

    def to_dict(self) -> dict:
        return {"rank": self.rank, "instance": self.instance, **self.violation.to_dict()}


def gather_violations(violations: list[Violation], instance: str, dst: int = 0, group=None
                      ) -> list[RankedViolation] | None:
    """Collective: every rank sends its violations; ``dst`` gets them all with their ranks (others: None).

    Rows keep each rank's order; ranks come in rank order.
    """
    rank = dist.get_rank(group)
    mine = (rank, instance, list(violations))
    out = [None] * dist.get_world_size(group) if rank == dst else None
    dist.gather_object(mine, out, dst=dist.get_global_rank(group, dst) if group is not None else dst, group=group)
    if out is None:
        return None
    return [RankedViolation(r, inst, v) for r, inst, vs in out for v in vs]
