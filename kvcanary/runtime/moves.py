"""Records outside a forward: the sweep of held slots, and the engine's KV copies, offloads and restores.

``RecordMoves`` is a part of ``Canary`` (``canary.py``): a sweep verifies slots the engine's prefix
cache holds against the TAIL records; a fork or defragmentation copy carries the source slots'
records to the destination slots, an offload saves the records of the slots it empties, a restore
writes them into the slots the KV came back to.
"""

from __future__ import annotations

import torch

from kvcanary import ops
from kvcanary.ops import validate as v
from kvcanary.runtime.checks import slots_tensor


class RecordMoves:
    """Needs the canary's ``groups``, ``launcher``, ``ring``, ``counters``, ``monitor``, ``injector``."""

    def sweep(self, slots: torch.Tensor, positions: torch.Tensor, prevs: torch.Tensor, group: str = "full") -> None:
        """Verify slots held by the engine's prefix cache (SPEC 4.5) against the TAIL buffers.

        Args: slots, positions, prevs: int32/int64 [n] triples from the engine's cache walker
        (prev = slot of position - 1, -1 at position 0). More than ``sweep_capacity`` triples are
        verified in several launches. Violations reach ``flush()`` at once, or the next step's drain.
        """
        if not self.enabled:
            return
        g = self._group(group)
        slots = slots_tensor("sweep", "slots", slots, g.num_slots, self.device)
        n = slots.shape[0]
        for name, t in (("positions", positions), ("prevs", prevs)):
            v.check_vector("sweep", name, v.check_tensor("sweep", name, t), v.INDEX_DTYPES, length=n)
        cap = g.sweep_entries.capacity
        self.launcher.hand_over(slots, positions, prevs)
        with self.launcher.side():
            self.launcher.streams.note("sweep", reads=("tail_bufs", "kv"), writes=("sweep_entries",),
                                       atomic=("ring", "counters"))
            for at in range(0, n, cap) if n else [0]:
                ops.fill_entries(g.sweep_entries, slots[at:at + cap], positions[at:at + cap], prevs[at:at + cap])
                for kv in g.kvs:
                    ops.verify(buf=g.bufs["tail", kv], entries=g.sweep_entries, ring=self.ring,
                               counters=self.counters, launch_tag=g.tag("sweep", kv), sources=g.sources[kv],
                               real_kv_mode=self._mode(g, kv), backend=self.config.backend)
        self._sweeps_unsnapshotted = self._open is None
        self.monitor.note_sweep(group)

    def copy_records(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, group: str = "full") -> None:
        """The engine copied KV from src_slots to dst_slots (fork, defragmentation): carry the records."""
        g = self._group(group)
        src = slots_tensor("copy_records", "src_slots", src_slots, g.num_slots, self.device)
        dst = slots_tensor("copy_records", "dst_slots", dst_slots, g.num_slots, self.device, length=src.shape[0])
        self.launcher.hand_over(src, dst)
        with self.launcher.side():
            self.launcher.streams.note("copy_records", reads=("head_bufs", "tail_bufs"),
                                       writes=("head_bufs", "tail_bufs"))
            for buf in g.bufs.values():
                buf.index_copy_(0, dst, buf.index_select(0, src))
        if self.injector is not None:
            self.injector.follow_copy(src, dst, group)

    def save_records(self, slots: torch.Tensor, group: str = "full") -> dict:
        """Records of slots whose KV is offloaded (a copy per buffer, on the canary's device)."""
        g = self._group(group)
        idx = slots_tensor("save_records", "slots", slots, g.num_slots, self.device)
        self.launcher.hand_over(idx)
        with self.launcher.side():
            self.launcher.streams.note("save_records", reads=("head_bufs", "tail_bufs"))
            saved = {key: buf.index_select(0, idx) for key, buf in g.bufs.items()}
        # the copies are read back on the engine's stream as well (restore, offload to host memory)
        self.launcher.join()
        return saved

    def restore_records(self, saved: dict, slots: torch.Tensor, group: str = "full") -> None:
        """The offloaded KV came back into ``slots`` (same order as saved): restore its records."""
        g = self._group(group)
        idx = slots_tensor("restore_records", "slots", slots, g.num_slots, self.device)
        if not isinstance(saved, dict) or set(saved) != set(g.bufs):
            raise TypeError(f"kv-canary: restore_records saved must be the dict save_records returned for group "
                            f"{group!r}, got {type(saved).__name__}"
                            + (f" with keys {sorted(saved)}" if isinstance(saved, dict) else ""))
        for key, buf in g.bufs.items():
            rec = saved[key]
            shape = (idx.shape[0], buf.shape[1])
            if not isinstance(rec, torch.Tensor) or rec.dtype != torch.uint8 or tuple(rec.shape) != shape:
                raise ValueError(f"kv-canary: restore_records saved[{key}] must be uint8 records of shape {shape} "
                                 f"(one per slot), got {getattr(rec, 'dtype', type(rec).__name__)} "
                                 f"{tuple(getattr(rec, 'shape', ()))}")
        self.launcher.hand_over(idx, *saved.values())
        with self.launcher.side():
            self.launcher.streams.note("restore_records", writes=("head_bufs", "tail_bufs"))
            for key, buf in g.bufs.items():
                buf.index_copy_(0, idx, saved[key].to(self.device))
        if self.injector is not None:
            self.injector.follow_restore(saved, idx, group)
