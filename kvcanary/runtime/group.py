"""One address space of a ``Canary`` (FULL or SWA): its real-KV sources, canary buffers, static plan, launch tags."""

from __future__ import annotations

from kvcanary import ops
from kvcanary.format import launch_tag
from kvcanary.ops import validate as v


class Group:
    """One address space (FULL or SWA) with its canary buffers and static plan."""

    def __init__(self, name, num_slots, window, table, k_sources, v_sources, cfg, real_kv_mode, plan_capacity,
                 sweep_capacity, max_batch, device):
        self.name, self.num_slots, self.window, self.table = name, num_slots, window, table
        self.sources = {kv: v.check_sources("Canary", srcs, real_kv_mode, device)
                        for kv, srcs in (("k", k_sources), ("v", v_sources))}
        self.kvs = ("k", "v") if cfg.check_v else ("k",)
        self.bufs = {(phase, kv): ops.allocate_canary_buffer(num_slots, cfg.record_stride, device)
                     for phase in ("head", "tail") for kv in self.kvs}
        self.plan = ops.Plan.allocate(plan_capacity, max_batch, device)
        self.sweep_entries = ops.Entries.allocate(sweep_capacity or num_slots, device)
        self._tags = {(p, kv): int(launch_tag(p, kv, name)) for p in ("head", "tail", "sweep") for kv in ("k", "v")}

    def tag(self, phase: str, kv: str) -> int:  # (the launch tag of a phase's op on one of K / V)
        return self._tags[phase, kv]
