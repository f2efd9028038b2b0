"""Canary configuration: a frozen dataclass, overridable from ``KV_CANARY_*`` environment variables.

Each field's environment variable is its upper-case name behind ``KV_CANARY_``;
docs/configuration.md holds the one table that documents them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from kvcanary.format import DEFAULT_RECORD_STRIDE

MODES = ("none", "log", "raise")
REAL_KV_MODES = ("none", "partial", "all")
ENV_PREFIX = "KV_CANARY_"
INJECT_PROBS = ("inject_table_prob", "inject_kv_prob", "inject_cached_prob", "inject_after_prob", "inject_swap_prob")


@dataclass(frozen=True)
class CanaryConfig:
    """Knobs of a ``Canary``; ``CanaryConfig.from_env()`` reads the ``KV_CANARY_*`` variables.

    Attributes:
        mode: "none" (nothing runs), "log" (warn and keep serving), "raise" (error after the drain).
        backend: op implementation, "auto" | "reference" | "torch" | "triton".
        check_v: also keep V buffers (and V real-KV hashes) besides K.
        real_kv: real-KV fingerprint at TAIL and sweep: "none" | "partial" (16 bytes) | "all".
        token_check: verify stored tokens against request token histories when the engine gives them.
        input_check: write-input assert when the engine gives expected input ids/positions.
        chain_position_check: chain-position assert at write (armed by ``Canary.mark_ready``).
        sweep_interval: run the prefix-cache sweep every N steps (0 = only on ``Canary.sweep`` calls).
        ring_capacity: violation rows kept per step (the count keeps growing past it).
        plan_capacity: verify entries per forward and group; 0 = max_batch * max_context.
        sweep_capacity: entries per sweep; 0 = the group's slot count.
        record_stride: bytes per canary record (>= 32, multiple of 8; >= 48 keeps writer attribution).
        warmup_steps: steps before the health check may fire.
        health_interval: steps between health checks (0 = off).
        stats_interval: steps between stats log lines (0 = off).
        report_blocks: readable violation blocks logged per drain (every violation still gets its line).
        inject_table_prob: self-test, per step: point a req_to_token cell this forward reads at another live slot.
        inject_kv_prob: self-test, per step: flip a KV byte of a slot this forward reads (needs real_kv, KV sources).
        inject_cached_prob: self-test, per sweep step: flip a KV byte of a slot only the prefix cache holds.
        inject_after_prob: self-test, per step: flip a KV byte of a slot just written, after the forward.
        inject_swap_prob: self-test, per sample: swap two requests' next tokens (needs the token oracle).
        inject_seed: seed of the fault-injection random generator.
        inject_warmup: forward steps before the first injection.
        inject_group: address space the KV-byte flips target: "full" | "swa".
        overlap: on CUDA, run verify and write launches on a side stream beside the forward (same results).
        launch_graphs: with overlap, replay each batch shape's verify and write launches from a CUDA graph (not faster on H200).
    """

    mode: str = "log"
    backend: str = "auto"
    check_v: bool = False
    real_kv: str = "partial"
    token_check: bool = True
    input_check: bool = True
    chain_position_check: bool = True
    sweep_interval: int = 0
    ring_capacity: int = 1024
    plan_capacity: int = 0
    sweep_capacity: int = 0
    record_stride: int = DEFAULT_RECORD_STRIDE
    warmup_steps: int = 2
    health_interval: int = 50
    stats_interval: int = 0
    report_blocks: int = 5
    inject_table_prob: float = 0.0
    inject_kv_prob: float = 0.0
    inject_cached_prob: float = 0.0
    inject_after_prob: float = 0.0
    inject_swap_prob: float = 0.0
    inject_seed: int = 0
    inject_warmup: int = 0
    inject_group: str = "full"
    overlap: bool = True
    launch_graphs: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"kv-canary: config mode must be one of {MODES}, got {self.mode!r}")
        if self.real_kv not in REAL_KV_MODES:
            raise ValueError(f"kv-canary: config real_kv must be one of {REAL_KV_MODES}, got {self.real_kv!r}")
        from kvcanary.ops.api import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"kv-canary: config backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.record_stride < 32 or self.record_stride % 8:
            raise ValueError(f"kv-canary: config record_stride must be >= 32 and a multiple of 8, "
                             f"got {self.record_stride}")
        if self.ring_capacity < 1:
            raise ValueError(f"kv-canary: config ring_capacity must be >= 1, got {self.ring_capacity}")
        for name in ("sweep_interval", "plan_capacity", "sweep_capacity", "warmup_steps", "health_interval",
                     "stats_interval", "report_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"kv-canary: config {name} must be >= 0, got {getattr(self, name)}")
        for name in INJECT_PROBS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"kv-canary: config {name} must be in [0, 1], got {getattr(self, name)}")
        if self.inject_warmup < 0:
            raise ValueError(f"kv-canary: config inject_warmup must be >= 0, got {self.inject_warmup}")
        if self.inject_group not in ("full", "swa"):
            raise ValueError(f"kv-canary: config inject_group must be 'full' or 'swa', got {self.inject_group!r}")

    @property
    def injecting(self) -> bool:
        """Whether any fault-injection probability is above 0 (see docs/fault_injection.md)."""
        return any(getattr(self, name) > 0 for name in INJECT_PROBS)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> CanaryConfig:
        """Defaults, then ``KV_CANARY_<FIELD>`` variables, then keyword overrides."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                values[field.name] = _parse(field, raw)
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes) -> CanaryConfig:
        return dataclasses.replace(self, **changes)


def _parse(field: dataclasses.Field, raw: str):
    name = ENV_PREFIX + field.name.upper()
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    if kind == "bool":
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"kv-canary: {name} must be a boolean (1/0/true/false), got {raw!r}")
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"kv-canary: {name} must be an integer, got {raw!r}") from None
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"kv-canary: {name} must be a number, got {raw!r}") from None
    return raw.strip()


def env_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every knob, for docs and ``kvcanary config``."""
    doc = CanaryConfig.__doc__ or ""
    meanings = {}
    for line in doc.splitlines():
        line = line.strip()
        if ":" in line and line.split(":")[0].isidentifier():
            key, text = line.split(":", 1)
            meanings[key] = text.strip()
    return [(ENV_PREFIX + f.name.upper(), repr(f.default), meanings.get(f.name, ""))
            for f in dataclasses.fields(CanaryConfig)]
