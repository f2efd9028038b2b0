"""The simulated KV memory: slot pages, request rows, ``req_to_token`` and the SWA address space.

Slot assignment follows a paged engine with a block-table view of ``req_to_token``:
when a request needs a new page, the whole page is reserved and all of its cells are
written into the request's row; positions inside an already reserved page take the
slot their row cell names. With an SWA layer every full slot that holds KV also gets
an SWA slot through ``full_to_swa`` (0 = none / evicted), freed by window eviction
once its position is older than the window (SGLang's ``free_swa``).
"""

from __future__ import annotations

import torch

from kvcanary.sim.allocator import PageAllocator, RowAllocator
from kvcanary.sim.config import SimConfig
from kvcanary.sim.request import Request


class KvPool:
    """Pages, rows, the request table and the full->SWA table of one engine.

    Attributes:
        table: int32 [num_rows, max_context] ``req_to_token`` (row 0 = padding).
        full_to_swa: int64 [num_slots] full slot -> SWA slot (None without SWA).
    """

    def __init__(self, cfg: SimConfig, bugs):
        self.ps = cfg.page_size
        self.window = cfg.swa_window
        self.max_context = cfg.max_context
        self.bugs = bugs
        self.pages = PageAllocator(cfg.num_slots, cfg.page_size)
        self.rows = RowAllocator(cfg.num_rows)
        self.table = torch.zeros(cfg.num_rows, cfg.max_context, dtype=torch.int32)
        self.swa = PageAllocator(cfg.num_slots, 1, stack=True) if self.window else None
        self.full_to_swa = torch.zeros(cfg.num_slots, dtype=torch.int64) if self.window else None
        # slots of the pages freed since the engine last took them (poison_on_free), else None
        self.freed: list[int] | None = None

    # -- sizes ---------------------------------------------------------------------------------
    def reserved_end(self, kv_len: int, planted: bool = False) -> int:
        """End position of the request's last reserved page (positions below it have a slot)."""
        ps = self.ps
        if planted and kv_len % ps == 0 and kv_len and self.bugs.hit("page_edge"):
            # Planted: floor + 1 instead of ceil; on a page edge the next, unreserved page counts as reserved.
            return (kv_len // ps + 1) * ps
        return -(-kv_len // ps) * ps

    def pages_needed(self, kv_len: int, n: int) -> int:
        return -(-max(0, kv_len + n - self.reserved_end(kv_len)) // self.ps)

    # -- rows ----------------------------------------------------------------------------------
    def alloc_row(self) -> int | None:
        return self.rows.alloc()

    def free_row(self, row: int) -> None:
        self.rows.free(row)

    def write_row(self, row: int, start: int, slots: list[int]) -> None:
        if slots:
            self.table[row, start:start + len(slots)] = torch.tensor(slots, dtype=torch.int32)

    # -- slots ---------------------------------------------------------------------------------
    def extend(self, req: Request, n: int) -> list[int] | None:
        """Slots for positions [kv_len, kv_len + n) of ``req`` (appended to ``req.slots``), or None.

        Reserved cells of the last page are used first, then whole new pages, all of whose
        cells are written into the row. Nothing changes when the pages are not there.
        """
        ps, row, start = self.ps, req.row, req.kv_len
        end = start + n
        reserved = self.reserved_end(start, planted=True)
        pages = self.pages.alloc(-(-max(0, end - reserved) // ps))
        if pages is None:
            return None
        new = self.table[row, start:min(end, reserved)].tolist()
        for k, page in enumerate(pages):
            first = reserved + k * ps
            slots = self.pages.page_slots(page)
            cells = ps
            if end - first < ps and self.bugs.hit("stale_table_tail"):
                # Planted: the row is written only up to the request's length; the rest of the page keeps stale ids.
                cells = end - first
            cells = min(cells, self.max_context - first)
            self.write_row(row, first, slots[:cells])
            new.extend(slots[:min(ps, end - first)])
        self._map_swa(new)
        req.slots.extend(new)
        return new

    def alloc_run(self, n: int) -> list[int] | None:
        """n slots in fresh whole pages, outside any row (scratch space, load-back targets)."""
        pages = self.pages.alloc(-(-n // self.ps))
        if pages is None:
            return None
        slots = [s for p in pages for s in self.pages.page_slots(p)][:n]
        self._map_swa(slots)
        return slots

    def _map_swa(self, slots: list[int]) -> None:
        if self.swa is None or not slots:
            return
        got = self.swa.alloc(len(slots)) or [0] * len(slots)
        self.full_to_swa[torch.tensor(slots, dtype=torch.int64)] = torch.tensor(got, dtype=torch.int64)

    def free(self, slots: list[int]) -> None:
        """Free the pages holding ``slots`` (and the SWA slots of every slot in them)."""
        pages = self.pages.pages_of(slots)
        if not pages:
            return
        if self.swa is not None:
            self.free_swa([s for p in pages for s in self.pages.page_slots(p)])
        self.pages.free(pages)
        if self.freed is not None:
            self.freed.extend(s for p in pages for s in self.pages.page_slots(p))

    def take_freed(self) -> list[int]:
        """The slots of pages freed since the last call that are still free (poison_on_free): a page freed and
        handed out again in between belongs to its new owner."""
        freed, self.freed = self.freed or [], [] if self.freed is not None else None
        free = set(self.pages.free_list())
        return [s for s in freed if self.pages.page_of(s) in free]

    def free_tail(self, slots: list[int], first_position: int) -> None:
        """Free the slots of positions >= first_position: pages past the position's page go back;
        cells inside its page stay reserved (only their SWA slots are freed)."""
        keep = self.reserved_end(first_position) - first_position
        self.free_swa(slots[:keep])
        self.free(slots[keep:])

    def free_swa(self, slots: list[int]) -> None:
        if self.swa is None or not slots:
            return
        idx = torch.tensor(slots, dtype=torch.int64)
        swa = self.full_to_swa[idx]
        self.swa.free(swa[swa > 0].tolist())
        self.full_to_swa[idx] = 0

    def swa_of(self, slots: list[int]) -> list[int]:
        if self.full_to_swa is None or not slots:
            return []
        return self.full_to_swa[torch.tensor(slots, dtype=torch.int64)].tolist()

    def swa_live(self, slots: list[int]) -> bool:
        return self.full_to_swa is None or all(x > 0 for x in self.swa_of(slots))

    def evict_window(self, req: Request) -> None:
        """Free the SWA slots of ``req``'s own positions older than the window, clearing their translation."""
        end = req.kv_len - self.window
        start = max(req.swa_evicted, req.cached_len)
        if self.swa is None or end <= start:
            return
        stop = end
        if end < req.kv_len and self.bugs.hit("window_edge"):
            # Planted: the free includes the window's first position, whose translation stays live.
            stop = end + 1
        freed = self.full_to_swa[torch.tensor(req.slots[start:stop], dtype=torch.int64)]
        self.swa.free(freed[freed > 0].tolist())
        self.full_to_swa[torch.tensor(req.slots[start:end], dtype=torch.int64)] = 0
        req.swa_evicted = end
