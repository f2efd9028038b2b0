"""Every request that read a bad slot, named: a violation row per failing verify entry, grouped per slot.

The verify writes one ring row per plan entry that fails (one per request and position). Rows carry no
request: the monitor rebuilds it from the forward's batch (the cells of its requests that map the row's
slot, narrowed by the row's checks: ``Monitor._reader``). When several requests read one bad slot alike
(a shared prefix block, a parent and its forks), their rows are identical in every field, so no row can
be told apart from another; what is exact is their number: one row per reader. ``assign`` gives the n
identical rows of an observation the n matching cells, one each, in batch order, and ``group`` names every
reader of the group on each of its violations (``Violation.readers``), so mode "abort" fails each of them
(each row names its own reader) and the report prints one block per group.

Where more cells match than rows were kept (a ring overflow drops rows), the first cells in batch order
are named: which of the identical rows were dropped cannot be known.
"""

from __future__ import annotations

import dataclasses

from kvcanary.runtime.report import Violation

__all__ = ["assign", "group"]


def assign(taken: dict, step: int, row: list[int], cells: list[tuple]) -> tuple:
    """The cell the next of ``row``'s identical rows in this observation names: ``cells`` ordered best match
    first (at least one); ``taken`` counts the rows named so far per row content."""
    key = (step, tuple(row))
    i = taken.get(key, 0)
    taken[key] = i + 1
    return cells[min(i, len(cells) - 1)]


def group(rows: list[list[int]], violations: list[Violation]) -> tuple[list[Violation], list[bool]]:
    """``violations`` (decoded from ``rows`` of one observation, in order) with ``readers`` /
    ``reader_positions`` set on every verify row that names a reader: the readers of all rows identical to
    it, in ring order, each once. Also, per violation, whether it leads its group (the first of identical
    rows, or a row of its own): the report prints the readable block of the leads only."""
    members: dict[tuple, list[int]] = {}
    for i, (row, v) in enumerate(zip(rows, violations)):
        if v.reader_request is not None and not v.is_write_check:
            members.setdefault(tuple(row), []).append(i)
    out, lead = list(violations), [True] * len(violations)
    for idx in members.values():
        seen: dict[int, int] = {}
        for i in idx:
            seen.setdefault(violations[i].reader_request, violations[i].reader_position)
        names, positions = tuple(seen), tuple(seen.values())
        for n, i in enumerate(idx):
            out[i] = dataclasses.replace(violations[i], readers=names, reader_positions=positions)
            lead[i] = n == 0
    return out, lead
