"""Canary configuration: a frozen dataclass, overridable from ``KV_CANARY_*`` environment variables.

Twenty-one variables in all (``VARIABLES``): the fifteen fields of ``ENV_FIELDS``, each its upper-case name
behind ``KV_CANARY_``; ``KV_CANARY_INJECT``, the fault-injection fields as one ``key=value,...`` spec;
``KV_CANARY_TRITON_FAST_LAUNCH``, read by the Triton launcher; and the vLLM integration's four
(``KV_CANARY_VLLM``, ``KV_CANARY_VLLM_REPORT_DIR``, ``KV_CANARY_VLLM_TP_INTERVAL``,
``KV_CANARY_VLLM_ALLOCATOR_INTERVAL``, read by ``kvcanary.integrations.vllm``). Other fields are set in code
(``CanaryConfig(...)``). docs/configuration.md holds the one table that documents them.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

from kvcanary.format import DEFAULT_RECORD_STRIDE
from kvcanary.ops.validate import parse_bool

MODES = ("none", "log", "raise", "abort")
REAL_KV_MODES = ("none", "partial", "all")
VALUE_CHECKS = ("auto", "always", "off")
WRITE_CHECK_LAYERS = ("fingerprinted", "all")
ENV_PREFIX = "KV_CANARY_"
INJECT_PROBS = ("inject_table_prob", "inject_kv_prob", "inject_cached_prob", "inject_after_prob", "inject_swap_prob")
# The fields a deployment sets without touching code. The rest (the checks one would only switch off to
# debug the canary, capacities, the launch-path toggles) are set in code: fewer variables to misspell.
ENV_FIELDS = ("mode", "backend", "check_v", "real_kv", "value_check", "sweep_interval", "ring_capacity",
              "plan_capacity", "health_interval", "stats_interval", "report_blocks", "check_before_forward",
              "write_check", "write_check_layers", "attention_check")
INJECT_VARIABLE = ENV_PREFIX + "INJECT"
# KV_CANARY_INJECT's keys: the inject_* field each sets (probabilities, seed, warm-up steps, address space)
INJECT_KEYS = {"table": "inject_table_prob", "kv": "inject_kv_prob", "cached": "inject_cached_prob",
               "after": "inject_after_prob", "swap": "inject_swap_prob", "seed": "inject_seed",
               "warmup": "inject_warmup", "group": "inject_group"}
# Variables with the prefix that are read elsewhere (not CanaryConfig fields): no "unknown variable" warning.
OTHER_VARIABLES = ("KV_CANARY_TRITON_FAST_LAUNCH", "KV_CANARY_VLLM", "KV_CANARY_VLLM_REPORT_DIR",
                   "KV_CANARY_VLLM_TP_INTERVAL", "KV_CANARY_VLLM_ALLOCATOR_INTERVAL")
VARIABLES = tuple(ENV_PREFIX + f.upper() for f in ENV_FIELDS) + (INJECT_VARIABLE,) + OTHER_VARIABLES
# Upper bounds of the size and count knobs (docs/configuration.md). Past them an allocation (a ring of
# 2**30 rows is 64 GiB, three more copies on CUDA) or a counter would fail at the first Canary or step,
# far from the setting and without naming it; each bound sits well above any engine's real need.
MAX_RECORD_STRIDE = 1024  # bytes per record: 128 int64 fields, 6 used
MAX_RING_CAPACITY = 1 << 20  # rows: 64 MiB per ring
MAX_ENTRIES = 1 << 27  # plan_capacity, sweep_capacity: 4 GiB of entries per group
MAX_COUNT = (1 << 31) - 1  # step intervals, warm-ups, report blocks
UPPER_BOUNDS = {"record_stride": MAX_RECORD_STRIDE, "ring_capacity": MAX_RING_CAPACITY,
                "plan_capacity": MAX_ENTRIES, "sweep_capacity": MAX_ENTRIES, "sweep_interval": MAX_COUNT,
                "allocator_check_interval": MAX_COUNT, "warmup_steps": MAX_COUNT, "health_interval": MAX_COUNT,
                "stats_interval": MAX_COUNT, "report_blocks": MAX_COUNT, "inject_warmup": MAX_COUNT}


class ConfigError(ValueError):
    """A config value out of its domain; ``from_env`` renames it after the variable it came from."""

    def __init__(self, field: str, expectation: str, got: object, *, name: str | None = None):
        self.field, self.expectation, self.got = field, expectation, got
        super().__init__(f"kv-canary: {name or 'config ' + field} must be {expectation}, got {got!r}")


class ConfigTypeError(ConfigError, TypeError):
    """A config value of the wrong type (``CanaryConfig(check_v="no")``)."""


@dataclass(frozen=True)
class CanaryConfig:
    """Knobs of a ``Canary``; ``CanaryConfig.from_env()`` reads the ``KV_CANARY_*`` variables.

    Attributes:
        mode: "none" (nothing runs), "log" (warn and keep serving), "raise" (error after the drain), "abort" (fail the
            requests that read wrong KV through the engine's error path, keep serving; the engine must implement it).
        backend: op implementation, "auto" | "reference" | "torch" | "numba" | "triton" ("auto": Triton on
            CUDA, numba on the CPU when it imports, else torch).
        check_v: also keep V buffers (and V real-KV hashes) besides K.
        real_kv: real-KV fingerprint at TAIL and sweep: "none" | "partial" (16 bytes) | "all".
        token_check: verify stored tokens against request token histories when the engine gives them.
        input_check: write-input assert when the engine gives expected input ids/positions.
        value_check: check batch values (rows, lengths, slots) before each forward: "auto" (when the canary is on the
            CPU, no device sync) | "always" (also on CUDA, where reading them syncs every forward) | "off".
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
        launch_graphs: with overlap, replay each batch shape's verify and write launches from a CUDA graph (not faster
            on H200).
        reserved_check: report a live token whose table cell or write slot is slot 0 or a ``PoolSpec.reserved_slots``
            slot (the ops skip slot 0 silently).
        nonfinite_check: report NaN/Inf in the KV a forward wrote (floating real-KV sources, at TAIL).
        poison_on_free: debug: ``Canary.poison_slots`` fills freed slots' KV with a NaN pattern, so a read of a freed
            slot fails its real-KV check.
        check_before_forward: read what HEAD found before the engine's forward runs (a device sync per forward on CUDA),
            so a bad read is reported, in mode "raise" raised, before the forward can fail on it.
        write_check: compare the KV bytes each written slot holds after the forward with the KV the layer computed for
            its token (the layers of ``write_check_layers``, K and V, where the engine hands the computed K/V over;
            docs/write_check.md); off: no hash at the cache update, no TAIL pass.
        write_check_layers: which layers the write check compares: "fingerprinted" (the real-KV hash's layers: by
            default the first layer's K and the last layer's V) | "all" (every attention layer's K and V the engine
            names; costs a row digest per layer at each cache update, docs/write_check.md "Cost").
        attention_check: compare the attention metadata the engine hands its kernel (per-request key lengths, the
            attention mask) with the read index the canary verified (docs/write_check.md).
        allocator_check_interval: check the allocator invariants (docs/allocator.md) every N steps where the engine
            gives a snapshot (``Canary.watch_allocator``); 0 = off.
    """

    mode: str = "log"
    backend: str = "auto"
    check_v: bool = False
    real_kv: str = "partial"
    token_check: bool = True
    input_check: bool = True
    value_check: str = "auto"
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
    check_before_forward: bool = False
    reserved_check: bool = True
    nonfinite_check: bool = True
    poison_on_free: bool = False
    allocator_check_interval: int = 0
    write_check: bool = True
    write_check_layers: str = "fingerprinted"
    attention_check: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_type(field.name, _kind(field), getattr(self, field.name))
        _choice("mode", self.mode, MODES)
        _choice("real_kv", self.real_kv, REAL_KV_MODES)
        _choice("value_check", self.value_check, VALUE_CHECKS)
        _choice("write_check_layers", self.write_check_layers, WRITE_CHECK_LAYERS)
        _choice("inject_group", self.inject_group, ("full", "swa"))
        from kvcanary.ops.api import BACKENDS

        _choice("backend", self.backend, BACKENDS)
        if self.record_stride < 32 or self.record_stride % 8:
            raise ConfigError("record_stride", ">= 32 and a multiple of 8", self.record_stride)
        if self.ring_capacity < 1:
            raise ConfigError("ring_capacity", ">= 1", self.ring_capacity)
        for name in ("sweep_interval", "allocator_check_interval", "plan_capacity", "sweep_capacity", "warmup_steps",
                     "health_interval", "stats_interval", "report_blocks", "inject_warmup"):
            if getattr(self, name) < 0:
                raise ConfigError(name, ">= 0", getattr(self, name))
        for name, bound in UPPER_BOUNDS.items():
            if getattr(self, name) > bound:
                raise ConfigError(name, f"<= {bound} (docs/configuration.md, 'Bounds')", getattr(self, name))
        for name in INJECT_PROBS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(name, "in [0, 1]", getattr(self, name))

    @property
    def injecting(self) -> bool:
        """Whether any fault-injection probability is above 0 (see docs/fault_injection.md)."""
        return any(getattr(self, name) > 0 for name in INJECT_PROBS)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> CanaryConfig:
        """Defaults, then ``KV_CANARY_<FIELD>`` variables, then keyword overrides.

        A bad variable raises ``ValueError`` naming it; a ``KV_CANARY_*`` variable that names no
        field warns (a typo would otherwise be ignored silently).
        """
        return cls._from_env(environ, overrides)[0]

    @classmethod
    def sources(cls, environ: dict[str, str] | None = None, **overrides) -> dict[str, str]:
        """Where each field's effective value comes from: "default", "environment" or "argument"."""
        return cls._from_env(environ, overrides)[1]

    @classmethod
    def _from_env(cls, environ, overrides) -> tuple[CanaryConfig, dict[str, str]]:
        environ = os.environ if environ is None else environ
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        fields = {ENV_PREFIX + name.upper(): by_name[name] for name in ENV_FIELDS}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in VARIABLES)
        if unknown:
            warnings.warn(f"kv-canary: unknown environment variables {unknown} ignored (known: {list(VARIABLES)}; "
                          f"other fields are set in code, CanaryConfig(...))", stacklevel=3)
        values, source, raws = {}, {name: "default" for name in by_name}, {}
        for var, field in fields.items():
            raw = environ.get(var)
            if raw is not None:
                values[field.name], source[field.name], raws[field.name] = _parse(field, raw), "environment", raw
        labels = {name: ENV_PREFIX + name.upper() for name in ENV_FIELDS}
        spec = environ.get(INJECT_VARIABLE)
        if spec is not None:
            for name, (value, key, raw) in _parse_inject(spec, by_name).items():
                values[name], source[name], raws[name] = value, "environment", raw
                labels[name] = f"{INJECT_VARIABLE} {key}"
        for name in overrides:
            source[name] = "argument"
        values.update(overrides)
        try:
            cfg = cls(**values)
        except ConfigError as e:
            if e.field in raws and e.field not in overrides:
                raise ValueError(f"kv-canary: {labels[e.field]} must be {e.expectation}, got "
                                 f"{raws[e.field]!r}") from None
            raise
        return cfg, source

    def replace(self, **changes) -> CanaryConfig:
        return dataclasses.replace(self, **changes)


def _kind(field: dataclasses.Field) -> str:
    return field.type if isinstance(field.type, str) else field.type.__name__


def _check_type(name: str, kind: str, value: object) -> None:
    # bool is an int subclass: reject it where a count is meant, and accept only real bools for flags.
    ok = {"bool": lambda x: isinstance(x, bool),
          "int": lambda x: isinstance(x, int) and not isinstance(x, bool),
          "float": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
          "str": lambda x: isinstance(x, str)}[kind](value)
    if not ok:
        expectation = {"bool": "a bool (True/False)", "int": "an int", "float": "a number", "str": "a str"}[kind]
        raise ConfigTypeError(name, expectation, value)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"one of {choices}", value)


def _parse_inject(spec: str, by_name: dict[str, dataclasses.Field]) -> dict[str, tuple[object, str, str]]:
    """``KV_CANARY_INJECT``'s ``key=value,...`` as {inject_* field: (value, key, raw value)} (``INJECT_KEYS``)."""
    out = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in INJECT_KEYS:
            raise ValueError(f"kv-canary: {INJECT_VARIABLE} must be comma-separated key=value pairs with keys "
                             f"{list(INJECT_KEYS)} (e.g. 'kv=0.05,seed=3'), got {spec!r}")
        name = INJECT_KEYS[key]
        out[name] = (_parse(by_name[name], raw.strip(), f"{INJECT_VARIABLE} {key}"), key, raw.strip())
    return out


def _parse(field: dataclasses.Field, raw: str, name: str | None = None):
    name = name or ENV_PREFIX + field.name.upper()
    kind = _kind(field)
    if kind == "bool":
        return parse_bool(name, raw)
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
    # Choices are lower-case words: read them case-insensitively, as the booleans are.
    return raw.strip().lower()


def field_meanings() -> dict[str, str]:
    """Each field's line of ``CanaryConfig``'s docstring, its continuation lines joined."""
    meanings: dict[str, str] = {}
    key = None
    for line in (CanaryConfig.__doc__ or "").split("Attributes:", 1)[-1].splitlines():
        line = line.strip()
        head = line.split(":", 1)[0]
        if ":" in line and head.isidentifier() and head in CanaryConfig.__dataclass_fields__:
            key, meanings[head] = head, line.split(":", 1)[1].strip()
        elif key is not None and line:
            meanings[key] += " " + line
    return meanings


def env_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every variable (``VARIABLES``), for docs and ``kvcanary config``."""
    meanings = field_meanings()
    defaults = {f.name: f.default for f in dataclasses.fields(CanaryConfig)}
    rows = [(ENV_PREFIX + name.upper(), repr(defaults[name]), meanings.get(name, "")) for name in ENV_FIELDS]
    keys = ", ".join(f"{k} ({name})" for k, name in INJECT_KEYS.items())
    rows.append((INJECT_VARIABLE, "''", f"fault injection (self-test, docs/fault_injection.md) as key=value pairs, "
                 f"e.g. 'kv=0.05,seed=3'; keys: {keys}."))
    rows.append(("KV_CANARY_TRITON_FAST_LAUNCH", "True", "launch compiled Triton kernels through their cached "
                 "launcher rather than triton's Python dispatch (same kernels; 0 for a profiler's launch hook)."))
    rows.append(("KV_CANARY_VLLM", "False", "vLLM: guard every forward of vLLM's model runner in every process (the "
                 "vllm.general_plugins entry point; docs/vllm.md)."))
    rows.append(("KV_CANARY_VLLM_REPORT_DIR", "''", "vLLM: a directory where each process appends its violation rows "
                 "and writes its stats (kvcanary-rank<R>-pid<P>.jsonl / .stats.json; read_reports)."))
    rows.append(("KV_CANARY_VLLM_TP_INTERVAL", "16", "vLLM with tensor parallelism: forwards between the ranks' "
                 "consistency exchanges (0: only when a report is collected)."))
    rows.append(("KV_CANARY_VLLM_ALLOCATOR_INTERVAL", "0", "vLLM with one worker: steps between checks of vLLM's "
                 "block pool (free queue, held blocks, ref counts; docs/allocator.md); 0 = off."))
    return rows
