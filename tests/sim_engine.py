"""A scripted paged-KV engine that drives the ops the way the runtime does, as pure data plus a replay.

``Script`` does the host bookkeeping (rows, slot allocation, SWA translation and eviction,
token histories) and records each forward as a ``Forward``. ``replay`` runs those forwards on a
state dict with one backend: expected-token scatter, then per buffer group plan, HEAD verify,
HEAD write, the engine's KV write, TAIL verify (real-KV) and TAIL write. Planted bugs are
closures on the state, so the same script replays identically on every backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvcanary import ops
from kvcanary.format import LaunchTag, RealKvMode, oracle_token
from kvcanary.ops import allocate_canary_buffer, allocate_counters

from ops_harness import flip_kv_byte, kv_source, poisoned_plan, poisoned_ring


@dataclasses.dataclass
class Forward:
    rows: list[int] = dataclasses.field(default_factory=list)
    prefix: list[int] = dataclasses.field(default_factory=list)
    extend: list[int] = dataclasses.field(default_factory=list)
    locs: list[int] = dataclasses.field(default_factory=list)
    locs_swa: list[int] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)
    pos: list[int] = dataclasses.field(default_factory=list)
    expected_ids: list[int] = dataclasses.field(default_factory=list)
    expected_pos: list[int] = dataclasses.field(default_factory=list)
    writer_ids: list[int] = dataclasses.field(default_factory=list)
    history: list[list[int]] = dataclasses.field(default_factory=list)
    rtt_writes: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    swa_writes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    pre: list[Callable] = dataclasses.field(default_factory=list)  # before the forward (tables)
    mid: list[Callable] = dataclasses.field(default_factory=list)  # after the engine's KV write


@dataclasses.dataclass
class Config:
    num_slots: int = 40
    num_rows: int = 6
    max_ctx: int = 24
    max_batch: int = 6
    plan_capacity: int = 96
    ring_capacity: int = 64
    stride: int = 48
    window: int = 0
    swa_slots: int = 0
    sources: tuple = ((torch.float16, 1, 32, 32, 0),)  # (dtype, page_size, nbpt, read_bytes, pad_bytes)
    mode: int = RealKvMode.ALL
    index_dtype: torch.dtype = torch.int64
    token_checks: bool = True
    token_offset: int = 0
    chain_check: bool = True
    write_assert: bool = True
    device: str = "cpu"


def kv_bytes(token: int, position: int, n: int) -> torch.Tensor:
    """Deterministic KV bytes the engine writes for (token, position)."""
    return (torch.arange(n) * 7 + token * 31 + position * 13).remainder(256).to(torch.uint8)


class Script:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.free = list(range(1, cfg.num_slots))
        self.swa_free = list(range(1, cfg.swa_slots))
        self.reqs: dict[int, dict] = {}
        self.next_row = 1
        self.forwards: list[Forward] = []
        self.evict: list[tuple[int, int]] = []
        self.table_writes: list[tuple[int, int, int]] = []

    def add(self, rid: int, prompt: list[int], share_from: int | None = None, shared: int = 0) -> None:
        """New request; its first ``shared`` positions may map onto request share_from's slots (prefix cache)."""
        r = {"row": self.next_row, "tokens": list(prompt), "slots": []}
        if share_from is not None:
            src = self.reqs[share_from]
            r["tokens"] = src["tokens"][:shared] + r["tokens"]
            r["slots"] = src["slots"][:shared]
            self.table_writes += [(r["row"], p, s) for p, s in enumerate(r["slots"])]
        self.reqs[rid] = r
        self.next_row += 1

    def forward(self, sched: list[tuple[int, int]], pad: int = 0, bad_pos: dict | None = None,
                bad_tok: dict | None = None) -> Forward:
        """Extend each (rid, n); ``pad`` padding rows at the end; bad_pos/bad_tok: rid -> delta planted in writes."""
        cfg, fw = self.cfg, Forward(swa_writes=self.evict, rtt_writes=self.table_writes)
        self.evict, self.table_writes = [], []
        for rid, n in sched:
            r = self.reqs[rid]
            P = len(r["slots"])
            while len(r["tokens"]) < P + n + cfg.token_offset:
                r["tokens"].append(oracle_token(rid, len(r["tokens"]), 1000))
            new = [self.free.pop(0) for _ in range(n)]
            for k, s in enumerate(new):
                fw.rtt_writes.append((r["row"], P + k, s))
                tok = r["tokens"][P + k + cfg.token_offset]
                fw.locs.append(s)
                fw.expected_ids.append(tok)
                fw.expected_pos.append(P + k)
                fw.ids.append(tok + (bad_tok or {}).get(rid, 0))
                fw.pos.append(P + k + (bad_pos or {}).get(rid, 0))
                if cfg.window:
                    s2 = self.swa_free.pop(0)
                    fw.swa_writes.append((s, s2))
                    fw.locs_swa.append(s2)
            r["slots"] += new
            if cfg.window:
                # Positions that fall out of the next forward's window lose their SWA slot.
                for p in range(max(0, P - cfg.window), max(0, P + n - cfg.window)):
                    self.evict.append((r["slots"][p], 0))
            fw.rows.append(r["row"])
            fw.prefix.append(P)
            fw.extend.append(n)
            fw.writer_ids.append(1000 + rid)
            fw.history.append(r["tokens"][:P + n + cfg.token_offset])
        for _ in range(pad):
            fw.rows.append(0)
            fw.prefix.append(0)
            fw.extend.append(1)
            fw.writer_ids.append(-7)
            fw.history.append([])
            fw.locs.append(0)
            if cfg.window:
                fw.locs_swa.append(0)
            fw.ids.append(0)
            fw.pos.append(0)
            fw.expected_ids.append(0)
            fw.expected_pos.append(0)
        self.forwards.append(fw)
        return fw

    def slot(self, rid: int, position: int) -> int:
        return self.reqs[rid]["slots"][position]

    # Planted bugs (closures on the state).
    def swap_cells(self, fw: Forward, rid: int, a: int, b: int) -> None:
        row = self.reqs[rid]["row"]

        def swap(state):
            rtt = state["rtt"]
            rtt[row, a], rtt[row, b] = rtt[row, b].clone(), rtt[row, a].clone()
        fw.pre.append(swap)

    def flip_kv(self, fw: Forward, rid: int, position: int) -> None:
        slot = self.slot(rid, position)
        fw.mid.append(lambda state: flip_kv_byte(state["kv"][0], slot, byte=3))


def build_state(cfg: Config) -> dict:
    dev = torch.device(cfg.device)
    groups = ["full"] + (["swa"] if cfg.window else [])
    state = {
        "rtt": torch.zeros(cfg.num_rows, cfg.max_ctx, dtype=cfg.index_dtype, device=dev),
        "tokens": torch.zeros(cfg.num_rows, cfg.max_ctx + 1, dtype=torch.int32, device=dev),
        "ring": poisoned_ring(cfg.ring_capacity, dev),
        "counters": allocate_counters(dev),
        "chain_check": torch.tensor([int(cfg.chain_check)], dtype=torch.int32, device=dev),
        "step": torch.zeros(1, dtype=torch.int64, device=dev),
        "full_to_swa": torch.zeros(cfg.num_slots, dtype=cfg.index_dtype, device=dev) if cfg.window else None,
    }
    for g in groups:
        slots = cfg.num_slots if g == "full" else cfg.swa_slots
        state[f"plan_{g}"] = poisoned_plan(cfg.plan_capacity, cfg.max_batch, dev)
        state[f"head_{g}"] = allocate_canary_buffer(slots, cfg.stride, dev)
        state[f"tail_{g}"] = allocate_canary_buffer(slots, cfg.stride, dev)
        state["kv" if g == "full" else "kv_swa"] = [
            kv_source(slots, dtype=dt, page_size=ps, nbpt=nb, read_bytes=rb, pad_bytes=pad, device=dev, seed=i)
            for i, (dt, ps, nb, rb, pad) in enumerate(cfg.sources)]
    return state


def replay(state: dict, cfg: Config, forwards: list[Forward], backend: str) -> None:
    dev = state["rtt"].device
    idx = lambda xs: torch.tensor(xs, dtype=cfg.index_dtype, device=dev)  # noqa: E731
    for fw in forwards:
        for fn in fw.pre:
            fn(state)
        for row, p, s in fw.rtt_writes:
            state["rtt"][row, p] = s
        for f, s in fw.swa_writes:
            state["full_to_swa"][f] = s
        bs = len(fw.rows)
        token_kw = {}
        if cfg.token_checks:
            flat = [t for h in fw.history for t in h]
            offsets = [0]
            for h in fw.history:
                offsets.append(offsets[-1] + len(h))
            ops.scatter_req_token_ids(torch.tensor(flat, dtype=torch.int64, device=dev),
                                      torch.tensor(offsets, dtype=torch.int64, device=dev),
                                      torch.tensor(fw.rows, dtype=torch.int64, device=dev), state["tokens"],
                                      backend=backend)
            token_kw = dict(token_table=state["tokens"], token_valid_lens=idx([len(h) for h in fw.history]),
                            token_offset=cfg.token_offset)
        groups = ["full"] + (["swa"] if cfg.window else [])
        write_kw = dict(num_requests=bs, input_ids=idx(fw.ids), positions=idx(fw.pos), ring=state["ring"],
                        counters=state["counters"], chain_check=state["chain_check"],
                        writer_ids=torch.tensor(fw.writer_ids, dtype=torch.int64, device=dev), step=state["step"],
                        backend=backend)
        if cfg.write_assert:
            write_kw.update(expected_input_ids=idx(fw.expected_ids), expected_positions=idx(fw.expected_pos))
        for g in groups:
            swa = g == "swa"
            plan = state[f"plan_{g}"]
            ops.plan(req_pool_indices=idx(fw.rows), prefix_lens=idx(fw.prefix), extend_lens=idx(fw.extend),
                     req_to_token=state["rtt"], out=plan, window=cfg.window if swa else 0,
                     full_to_swa=state["full_to_swa"] if swa else None, backend=backend, **token_kw)
            tag = LaunchTag.HEAD_K_SWA if swa else LaunchTag.HEAD_K_FULL
            ops.verify(buf=state[f"head_{g}"], entries=plan.entries, ring=state["ring"], counters=state["counters"],
                       launch_tag=tag, backend=backend)
            ops.write(buf=state[f"head_{g}"], plan=plan, out_cache_loc=idx(fw.locs_swa if swa else fw.locs),
                      launch_tag=tag, **write_kw)
        # The engine's forward writes KV for every new token.
        for g in groups:
            sources = state["kv_swa" if g == "swa" else "kv"]
            for s, t, p in zip(fw.locs_swa if g == "swa" else fw.locs, fw.ids, fw.pos):
                for src in sources:
                    row, col = divmod(s, src.page_size)
                    nb = src.num_bytes_per_token
                    src.byte_rows()[row, col * nb:(col + 1) * nb] = kv_bytes(t, p, nb).to(dev)
        for fn in fw.mid:
            fn(state)
        for g in groups:
            swa = g == "swa"
            plan, sources = state[f"plan_{g}"], state["kv_swa" if swa else "kv"]
            tag = LaunchTag.TAIL_K_SWA if swa else LaunchTag.TAIL_K_FULL
            ops.verify(buf=state[f"tail_{g}"], entries=plan.entries, ring=state["ring"], counters=state["counters"],
                       launch_tag=tag, sources=sources, real_kv_mode=cfg.mode, backend=backend)
            ops.write(buf=state[f"tail_{g}"], plan=plan, out_cache_loc=idx(fw.locs_swa if swa else fw.locs),
                      launch_tag=tag, sources=sources, real_kv_mode=cfg.mode, **write_kw)
        state["step"] += 1
