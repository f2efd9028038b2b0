"""Engine bugs planted in vLLM V1's own code at run time: its block pool, KV-cache manager, prefix-cache
hashing, scheduler, model runner, block table and slot mapping.

Each bug is a monkeypatch of one vLLM object of a *running* engine (the scheduler's block pool or KV-cache
manager, the model runner, its block table, a vLLM module's function), installed and removed by ``plant``, a
context manager; no installed file changes. Each fires once, when the workload reaches the state it needs,
and counts it. Several replay published vLLM bugs (``PUBLISHED``), the rest are classes of shared/BUGS.md in
vLLM's code. Whether a bug made attention read wrong KV is judged by ``vllm_oracle.ShadowOracle``, not by the
canary; ``vllm_cases`` holds the workload that brings each bug about and the run that judges it.

Example:
    >>> llm = make_llm(tiny_model_dir())
    >>> with plant("phantom-prefix-hit", llm) as state:
    ...     drive(llm, arrivals)
    >>> state.fired
    1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

# name: (class of shared/BUGS.md, vLLM component, what goes wrong)
BUGS: dict[str, tuple[str, str, str]] = {
    "shared-block-double-free": ("A", "block pool", "a finished request's block list holds a block it shares with "
                                 "a running request twice: the free drops its count to 0 while still shared, and a "
                                 "newcomer takes and overwrites it"),
    "early-free": ("A", "KV-cache manager", "a decoding request's first block goes back to the free queue while its "
                   "table still maps it; the next allocation takes it"),
    "parentless-block-hash": ("F", "prefix-cache hashing", "a block's hash leaves out its parent: a block whose "
                              "tokens equal another prompt's later block hits it, at other positions"),
    "lora-salt-collision": ("F", "prefix-cache hashing", "the LoRA name and the cache salt enter the block hash as "
                            "one namespace string: a salted request without LoRA hits a LoRA request's KV"),
    "phantom-prefix-hit": ("F", "block pool", "a cached block handed out again keeps its hash-table entry: a later "
                           "prompt hits a block that now holds another request's KV"),
    "stale-inflight-write": ("B", "model runner", "a finished request's last in-flight write lands in its old block "
                             "after the block went to another request"),
    "slot-mapping-row-stride": ("C", "slot mapping", "the slot-mapping kernel steps through the block table with a "
                                "narrower row width than the table's: rows after the first load another row's ids"),
    "decode-write-prev-block": ("E", "slot mapping", "a decode token that opens a new block is written into the "
                                "previous block (block index off by one at the edge)"),
    "row-count-not-reset": ("C", "block table", "a reused block-table row keeps its old block count: the new "
                            "request's blocks are appended after the previous occupant's ids"),
    "row-keeps-old-ids": ("C", "block table", "a freed request's block-table row keeps its old block ids past the "
                          "next occupant's end"),
    "resumed-keeps-old-blocks": ("A", "model runner / preemption", "the runner extends a request resumed after preemption with its "
                                 "new blocks instead of replacing its freed pre-preemption blocks"),
    "chunk-skips-a-token": ("E", "scheduler / chunked prefill", "the scheduler advances a chunked prefill one token too far: the "
                            "next chunk starts past a position nobody computes"),
    "zero-delivered-block": ("B", "model runner", "the runner's zeroing of new blocks runs over a block a prefix-cache "
                             "hit just delivered to a new request"),
    "v-write-dropped": ("G", "attention backend / cache write", "one forward's cache writes store each token's K "
                        "and leave its V as it was (a write path that never writes V): every later read of those "
                        "slots reads stale V under records and a real-KV hash that match"),
    "tp-rank-slot-shift": ("E", "tensor-parallel ranks", "on one tensor-parallel rank only, a decode token's slot is "
                           "its successor's: that rank's shard of the KV lands in the wrong slot"),
}

# The published vLLM bugs whose mechanism a planted bug replays (shared/BUGS.md).
PUBLISHED: dict[str, str] = {
    "shared-block-double-free": "vllm#42571 (a block listed twice; the free decrements twice)",
    "slot-mapping-row-stride": "vllm#53982 / PR #54296 (the slot-mapping kernel reads the next row's block ids)",
    "stale-inflight-write": "vllm PR #45357 (a stale in-flight write lands in blocks already reassigned)",
    "lora-salt-collision": "vllm#44701 (LoRA name and cache salt share block hashes)",
    "phantom-prefix-hit": "local-inference-lab/vllm#480 (phantom prefix-cache hits after a full eviction)",
    "row-keeps-old-ids": "vllm#42494 (block-table rows keep old ids past a request's end)",
    "zero-delivered-block": "vllm PR #47373 (the zeroing of new blocks erases KV just delivered)",
}

RUNNER_SIDE = ("stale-inflight-write", "slot-mapping-row-stride", "decode-write-prev-block", "row-count-not-reset",
               "row-keeps-old-ids", "resumed-keeps-old-blocks", "zero-delivered-block", "tp-rank-slot-shift",
               "v-write-dropped")


@dataclass
class BugState:
    """What a planted bug did: how often it fired, and what (for the report)."""

    name: str
    fired: int = 0
    notes: list[str] = field(default_factory=list)
    memo: dict = field(default_factory=dict)

    def fire(self, note: str) -> bool:
        """Fire once: True the first time (the bug then acts), False after."""
        if self.fired:
            return False
        self.fired += 1
        self.notes.append(note)
        return True


class Patches:
    """Monkeypatches of attributes (instance, class or module), undone exactly in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, bool, object]] = []

    def set(self, obj, name: str, value) -> None:
        own = name in vars(obj) if hasattr(obj, "__dict__") else True
        self._undo.append((obj, name, own, vars(obj).get(name) if own else None))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._undo:
            obj, name, own, old = self._undo.pop()
            if own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


@contextlib.contextmanager
def plant(name: str, llm=None, *, core=None, runner=None, rank: int = 0) -> Iterator[BugState]:
    """Plant bug ``name`` into a running vLLM engine for the block; removes it on exit.

    Scheduler-side bugs patch ``core`` (the engine core; default: ``llm``'s in-process one), runner-side bugs
    (``RUNNER_SIDE``) patch ``runner`` (default: ``llm``'s single worker; with tensor parallelism, each rank's
    runner through ``LLM.collective_rpc``, ``rank`` naming it)."""
    if name not in BUGS:
        raise ValueError(f"kv-canary: vLLM bug must be one of {sorted(BUGS)}, got {name!r}")
    from kvcanary.sim import vllm_planters
    from kvcanary.sim.vllm_drive import engine_core, runner_of

    state, patches = BugState(name), Patches()
    if name in RUNNER_SIDE:
        target = runner if runner is not None else runner_of(llm)
    else:
        target = core if core is not None else engine_core(llm)
    getattr(vllm_planters, name.replace("-", "_"))(patches, state, target, rank)
    try:
        yield state
    finally:
        patches.undo()
