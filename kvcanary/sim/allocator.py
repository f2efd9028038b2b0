"""Slot and row allocators of the simulated KV pool.

``PageAllocator`` hands out whole pages of ``page_size`` slots; page 0 (and slot 0
with it) is reserved for padded-token writes and never handed out. Like SGLang's
allocator after ``merge_and_sort_free``, the lowest free page goes first, so a freed
page is reused soon: lifetime bugs surface quickly instead of hiding in a long queue.
Nothing here checks for double frees, as in real engines: a page freed twice is
simply handed out twice.
"""

from __future__ import annotations

import heapq


class PageAllocator:
    """Whole-page allocator over ``num_slots`` slots.

    Args:
        num_slots: slots of the pool, slot 0 included (a multiple of page_size).
        page_size: slots per page (>= 1).

    Example:
        >>> a = PageAllocator(16, 4)
        >>> a.alloc(2)
        [1, 2]
        >>> a.page_slots(2)
        [8, 9, 10, 11]
    """

    def __init__(self, num_slots: int, page_size: int, stack: bool = False):
        if page_size < 1 or num_slots % page_size or num_slots < 2 * page_size:
            raise ValueError(f"kv-canary: PageAllocator needs page_size >= 1 and num_slots a multiple of it with "
                             f"at least 2 pages, got num_slots={num_slots} page_size={page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.stack = stack
        self.on_free = None  # called with each freed page list (the canary's AllocatorCheck.note_free)
        self._free = list(range(1, self.num_pages))
        if stack:
            self._free.reverse()  # the lowest page on top
        else:
            heapq.heapify(self._free)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, num_pages: int) -> list[int] | None:
        """The ``num_pages`` lowest free pages (last freed first with ``stack``), or None (nothing taken) if fewer."""
        if num_pages > len(self._free):
            return None
        if self.stack:
            return [self._free.pop() for _ in range(num_pages)]
        return [heapq.heappop(self._free) for _ in range(num_pages)]

    def free(self, pages) -> None:
        """Return pages to the free list (page 0 is ignored)."""
        if self.on_free is not None:
            self.on_free(pages)
        for page in pages:
            if page > 0:
                if self.stack:
                    self._free.append(page)
                else:
                    heapq.heappush(self._free, page)

    def page_of(self, slot: int) -> int:
        return slot // self.page_size

    def page_slots(self, page: int) -> list[int]:
        return list(range(page * self.page_size, (page + 1) * self.page_size))

    def pages_of(self, slots) -> list[int]:
        """Distinct pages holding ``slots``, in first-seen order (slot 0's page excluded)."""
        seen: dict[int, None] = {}
        for s in slots:
            if s > 0:
                seen.setdefault(s // self.page_size, None)
        return [p for p in seen if p > 0]

    def is_free(self, page: int) -> bool:
        return page in self._free

    def free_list(self) -> list[int]:
        """Sorted copy of the free pages (duplicates kept: they are double frees)."""
        return sorted(self._free)


class RowAllocator:
    """Rows of ``req_to_token``: row 0 is the padding row; the lowest free row goes first."""

    def __init__(self, num_rows: int):
        if num_rows < 2:
            raise ValueError(f"kv-canary: RowAllocator num_rows must be >= 2, got {num_rows}")
        self.num_rows = num_rows
        self._free = list(range(1, num_rows))
        heapq.heapify(self._free)

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def free(self, row: int) -> None:
        if row > 0:
            heapq.heappush(self._free, row)

    def free_list(self) -> list[int]:
        return sorted(self._free)
