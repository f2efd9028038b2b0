"""Request-level prefix caching: admission with a prefix match, inserts, releases, retraction.

The SGLang calls it mirrors: ``match_prefix`` + lock on admission (loading host-only
pages back when offload is on), ``cache_unfinished_req`` after a prefill (insert
the computed pages, free duplicates, point the row at the tree's slots, move the
lock), ``cache_finished_req`` on finish (insert, free duplicates and the unshared
tail, unlock, free the row), and the no-insert release of aborts and retractions.
"""

from __future__ import annotations

from kvcanary.sim.request import Request


class CacheManager:
    """Prefix-cache bookkeeping of requests over a ``KvPool`` and a ``RadixCache``."""

    def __init__(self, pool, tree, host, bugs):
        self.pool, self.tree, self.host, self.bugs = pool, tree, host, bugs
        self.ps = pool.ps
        self.window = pool.window
        self.hit_tokens = 0

    def free_pages_for(self, pages: int) -> bool:
        """Evict unlocked prefix-cache pages until ``pages`` are free; False if they cannot be."""
        short = pages - self.pool.pages.free_pages
        if short > 0:
            self.tree.evict(short, offload=self.host.offload if self.host is not None else None)
        return self.pool.pages.free_pages >= pages

    def admit(self, req: Request) -> bool:
        """Give ``req`` a row, its cached prefix (loaded back if on host) and a lock on it.

        The match covers at most len(tokens) - 1 tokens, so one token is always computed.
        False (and nothing held) when no row is free.
        """
        row = self.pool.alloc_row()
        if row is None:
            return False
        match = self.tree.match_prefix(req.tokens[:len(req.tokens) - 1])
        slots, node = match.slots, match.last_node
        if match.host_nodes and self.host is not None:
            self.tree.lock(node)
            pages = -(-match.host_len // self.ps)
            loaded = self.host.load_back(match.host_nodes) if self.free_pages_for(pages) else None
            self.tree.unlock(node)
            if loaded is not None:
                slots = slots + loaded
                node = next(n for n in reversed(match.host_nodes) if n.value is not None and n.host is not None)
        if self.window and slots:
            slots, node = self._live_window(req, slots, node)
        req.row = row
        req.slots = list(slots)
        req.cached_len = len(slots)
        req.last_node = node
        req.swa_evicted = 0
        self.tree.lock(node)
        self.pool.write_row(row, 0, req.slots)
        self.hit_tokens += len(slots)
        return True

    def _live_window(self, req: Request, slots: list[int], node):
        """Shorten an SWA match until the window before its end still has live SWA slots."""
        m = len(slots)
        while m > 0 and not self.pool.swa_live(slots[max(0, m - self.window):m]):
            m -= self.ps
        if m == len(slots):
            return slots, node
        if m <= 0:
            return [], self.tree.root
        match = self.tree.match_prefix(req.tokens[:m])
        return match.slots, match.last_node

    def cache_unfinished(self, req: Request) -> None:
        """After a prefill (chunk): insert the computed whole pages and take the tree's slots for them."""
        aligned = min(req.kv_len, len(req.tokens)) // self.ps * self.ps
        if aligned <= req.cached_len:
            return
        present = self.tree.insert(req.tokens[:aligned], req.slots[:aligned])
        if present > req.cached_len:
            # Another request inserted this range first: our copies are duplicates.
            self.pool.free(req.slots[req.cached_len:present])
            if not self.bugs.hit("insert_dup_stale_table"):
                tree_slots = self.tree.match_prefix(req.tokens[:aligned]).slots
                req.slots[req.cached_len:present] = tree_slots[req.cached_len:present]
                self.pool.write_row(req.row, req.cached_len, tree_slots[req.cached_len:present])
        node = self.tree.match_prefix(req.tokens[:aligned]).last_node
        self.tree.unlock(req.last_node)
        self.tree.lock(node)
        req.last_node = node
        req.cached_len = aligned

    def release(self, req: Request, insert: bool) -> None:
        """Give back ``req``'s KV: insert its whole pages into the tree (``insert``) or not, free the
        unshared rest, drop its lock and free its row."""
        slots, start = req.slots, req.cached_len
        if insert:
            aligned = min(req.kv_len, len(req.tokens)) // self.ps * self.ps
            present = self.tree.insert(req.tokens[:aligned], slots[:aligned])
            self.pool.free(slots[start:max(start, present)])
            self.pool.free(slots[aligned:])
        else:
            if start > 0 and req.aborted and self.bugs.hit("free_while_cached"):
                # Planted: the abort path frees from position 0, pages the prefix cache holds included.
                start = 0
            self.pool.free(slots[start:])
        self.tree.unlock(req.last_node)
        self.pool.free_row(req.row)
        req.freed = True

    def retract(self, req: Request) -> None:
        """Out of memory: drop ``req``'s KV (kept: its tokens) so it can be recomputed later."""
        self.release(req, insert=False)
        req.reset_kv()
        req.retractions += 1
