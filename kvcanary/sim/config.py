"""Knobs of the simulated engine, the named configurations the zoo runs, and what a run returns.

A ``SimConfig`` fixes everything a run depends on: the KV layout (page size, an
optional sliding-window pool), the scheduler features (chunked prefill, speculative
decoding, host offload), the memory budget, the workload size and its seed, and at
most one planted bug. Two runs with the same config are identical, step for step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class SimConfig:
    """One simulated engine and workload.

    Attributes:
        seed: workload seed (arrivals, prompts, lengths, aborts, draft guesses).
        page_size: slots per page; allocation is whole pages, page 0 (slot 0) is reserved.
        num_slots: slots of the full KV pool, slot 0 included (a multiple of page_size).
        swa_window: sliding window W of the SWA layer (0 = no SWA pool).
        spec_tokens: draft tokens per target-verify forward (0 = plain decode).
        accept_prob: chance that each draft token equals the target's token.
        chunk_size: prefill tokens per forward with chunked prefill (0 = whole prompts, budget below).
        prefill_budget: prefill tokens per forward without chunked prefill.
        offload: evicted prefix-cache pages go to a host pool and are loaded back on a hit.
        host_slots: token capacity of the host pool.
        max_running: requests decoding or prefilling at once (rows = max_running + 1, row 0 padding).
        max_context: columns of req_to_token.
        num_requests: requests in the workload.
        max_output: cap on a request's output tokens (workloads draw 1-32).
        max_steps: forward steps before the run stops.
        vocab: vocabulary size of the token oracle.
        num_layers: full-attention layers (up to four of them real-KV sources: ``MockModel.fingerprinted``).
        graph_sizes: padded batch sizes of decode/verify forwards ("CUDA graphs").
        sweep_interval: prefix-cache sweep every N steps.
        bug: name of the planted bug (``kvcanary.sim.bugs.BUGS``), None for a clean run.
        name: label of the configuration (reports only).
    """

    seed: int = 0
    page_size: int = 1
    num_slots: int = 1024
    swa_window: int = 0
    spec_tokens: int = 0
    accept_prob: float = 0.6
    chunk_size: int = 0
    prefill_budget: int = 96
    offload: bool = False
    host_slots: int = 512
    max_running: int = 6
    max_context: int = 160
    num_requests: int = 24
    max_output: int = 32
    max_steps: int = 160
    vocab: int = 32000
    num_layers: int = 2
    graph_sizes: tuple[int, ...] = (1, 4, 8)
    sweep_interval: int = 4
    bug: str | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"kv-canary: SimConfig page_size must be >= 1, got {self.page_size}")
        if self.num_slots % self.page_size or self.num_slots < 4 * self.page_size:
            raise ValueError(f"kv-canary: SimConfig num_slots must be a multiple of page_size ({self.page_size}) "
                             f"and hold at least 4 pages, got {self.num_slots}")
        if self.offload and self.swa_window:
            raise ValueError("kv-canary: SimConfig offload needs swa_window=0 (the sim offloads full-attention KV "
                             "only), got both")
        for name in ("swa_window", "spec_tokens", "chunk_size", "host_slots", "num_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"kv-canary: SimConfig {name} must be >= 0, got {getattr(self, name)}")
        for name in ("prefill_budget", "max_running", "max_steps", "sweep_interval", "num_layers", "max_output"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv-canary: SimConfig {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.accept_prob <= 1.0:
            raise ValueError(f"kv-canary: SimConfig accept_prob must be in [0, 1], got {self.accept_prob}")
        if self.max_running > max(self.graph_sizes):
            raise ValueError(f"kv-canary: SimConfig graph_sizes must cover max_running ({self.max_running}), "
                             f"got {self.graph_sizes}")
        if self.bug is not None:
            from kvcanary.sim.bugs import BUGS

            if self.bug not in BUGS:
                raise ValueError(f"kv-canary: SimConfig bug must be one of {sorted(BUGS)}, got {self.bug!r}")

    @property
    def num_rows(self) -> int:
        return self.max_running + 1

    @property
    def tokens_per_decode(self) -> int:
        """Tokens one decoding request feeds per forward: 1, or 1 + drafts when verifying."""
        return 1 + self.spec_tokens

    def replace(self, **changes) -> SimConfig:
        return dataclasses.replace(self, **changes)

    def features(self) -> str:
        """Short description, e.g. 'ps=4 swa=8 spec=3 chunk=16 slots=256 offload'."""
        parts = [f"ps={self.page_size}"]
        if self.swa_window:
            parts.append(f"swa={self.swa_window}")
        if self.spec_tokens:
            parts.append(f"spec={self.spec_tokens}")
        if self.chunk_size:
            parts.append(f"chunk={self.chunk_size}")
        parts.append(f"slots={self.num_slots}")
        if self.offload:
            parts.append("offload")
        return " ".join(parts)


# Memory pressure: pools small enough that the prefix cache evicts and decode retracts.
_PRESSURE = dict(num_slots=224, host_slots=1024)

# The zoo's configuration matrix: each feature appears with page size 1 and > 1.
MATRIX: dict[str, SimConfig] = {
    "base": SimConfig(name="base"),
    "paged": SimConfig(name="paged", page_size=4),
    "swa-chunked": SimConfig(name="swa-chunked", swa_window=8, chunk_size=16, num_slots=320),
    "spec": SimConfig(name="spec", spec_tokens=3),
    "spec-paged-swa": SimConfig(name="spec-paged-swa", page_size=4, swa_window=12, spec_tokens=3, chunk_size=24),
    "pressure-offload": SimConfig(name="pressure-offload", offload=True, **_PRESSURE),
    "pressure-paged-spec": SimConfig(name="pressure-paged-spec", page_size=4, chunk_size=16, spec_tokens=2,
                                     offload=True, **_PRESSURE),
}


def matrix(seed: int = 0, **overrides) -> list[SimConfig]:
    """The zoo matrix with ``seed`` (and any overrides) applied to every configuration."""
    return [cfg.replace(seed=seed, **overrides) for cfg in MATRIX.values()]


@dataclass
class SimResult:
    """What one run did and what the canary said about it."""

    config: str
    features: str
    seed: int
    bug: str | None
    steps: int
    planted_step: int | None  # first step the planted bug took effect (None: it never did)
    bug_hits: int
    violations: int  # total violations counted by the canary
    first_detected_step: int | None
    first_report: str | None  # launch tag and reasons of the first violation, e.g. "HEAD_K_FULL verify_token"
    reasons: list[str]
    launch_tags: list[str]
    finished: int
    aborted: int  # by the client (the workload)
    retractions: int
    cache_hit_tokens: int
    offloads: int
    loadbacks: int
    tokens_protected: int
    wall_s: float
    health_problems: list[str] = field(default_factory=list)
    # the canary's refusal of a forward whose batch gave one request row to two requests (SharedRowError):
    # the run ends there, as an engine's would on that error
    refused: str | None = None
    failed: int = 0  # requests failed through the engine's error path: the canary's mode "abort"

    @property
    def detected(self) -> bool:
        return self.violations > 0 or self.refused is not None

    def to_dict(self) -> dict:
        return asdict(self)
