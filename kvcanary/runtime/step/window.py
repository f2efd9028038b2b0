"""The sliding-window group's full->SWA table of one step, from an engine's read and write indices of both groups
(``runtime.engine.StepInputs``: ``read_index_storage[g]``, ``write_index_storage[g]``), for an engine that
reads a sliding group through a rolling buffer of its own (transformers' paged cache: the adapter's eager
steps, ``integrations/transformers/batch.BatchBuilder.finish``)."""

from __future__ import annotations

import torch

__all__ = ["fill_swa_table"]


def fill_swa_table(lay, table, io, prefix_t, extend_t, width: int, T: int, out_cache_loc, arange) -> None:
    """Synthetic full->SWA table ``table`` of a step, from the read and write indices of both groups
    (``lay``: the engine's ``window``, ``full_group``, ``swa_group`` and ``write_trash``; ``arange(n)``: the
    caller's cached index row).

    The sliding group's read index lists, per request, the rolling-buffer slots of its last
    ``c = min(prefix, W - 1)`` positions (then a sentinel per new token); the full group's read
    index the full slots of the same positions. Each such full slot maps to the sliding slot the
    forward reads, except positions this forward overwrites (``p < prefix + extend - W``), which
    map to 0 = evicted (their HEAD verify ran before the write; TAIL would see the new token).
    New tokens map their full write slot to their sliding write slot (0 for the write trash).
    """
    W = lay.window + 1
    table.zero_()
    if width:
        g, sg = lay.full_group, lay.swa_group
        c = prefix_t.clamp(max=lay.window)
        k = arange(width)  # [bs, width] grid of window cells; k >= c are not read
        full_start = torch.cumsum(prefix_t + extend_t, 0) - extend_t - c  # first window position, full read
        swa_start = torch.cumsum(c + extend_t, 0) - extend_t - c
        fr, sr = io.read_index_storage[g], io.read_index_storage[sg]
        full = fr.index_select(0, (full_start.unsqueeze(1) + k).view(-1).clamp_(max=fr.shape[0] - 1))
        swa = sr.index_select(0, (swa_start.unsqueeze(1) + k).view(-1).clamp_(max=sr.shape[0] - 1))
        p = (prefix_t - c).unsqueeze(1) + k
        keep = (p >= (prefix_t + extend_t - W).unsqueeze(1)).view(-1)
        inside = (k < c.unsqueeze(1)).view(-1)
        # Cells outside the window go to slot 0 (padding, never a real slot), cleared again below.
        table[torch.where(inside, full, 0)] = torch.where(keep, swa, 0)
        table[0] = 0
    if T:
        swa_w = io.write_index_storage[lay.swa_group, :T]
        table[out_cache_loc] = torch.where(swa_w == lay.write_trash, torch.zeros_like(swa_w), swa_w)
