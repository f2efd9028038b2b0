"""What the user asked for, read from the environment in every vLLM process alike.

vLLM starts its workers as separate processes: the only configuration that reaches all of them without a change
to vLLM is the environment they inherit. ``Settings.from_env`` reads the canary's ``CanaryConfig`` (the
``KV_CANARY_*`` variables, docs/configuration.md) and the integration's own three variables, and refuses what
the integration cannot do, before any model loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvcanary.runtime import CanaryConfig

from kvcanary.integrations.vllm.plugin import ALLOCATOR_INTERVAL_VARIABLE, REPORT_DIR_VARIABLE, TP_INTERVAL_VARIABLE

DEFAULT_TP_INTERVAL = 16  # forwards between the tensor-parallel ranks' consistency exchanges


@dataclass(frozen=True)
class Settings:
    """The canary's configuration in a vLLM process.

    Attributes:
        config: the ``CanaryConfig`` (``KV_CANARY_MODE``, ...).
        report_dir: where each process appends its violation rows and writes its stats (None: nowhere).
        tp_interval: forwards between the tensor-parallel consistency exchanges (0: only when a report is asked).
        allocator_interval: steps between checks of vLLM's block pool (docs/allocator.md; 0: off).
    """

    config: CanaryConfig
    report_dir: str | None
    tp_interval: int
    allocator_interval: int = 0

    @classmethod
    def from_env(cls, environ=None) -> Settings:
        environ = os.environ if environ is None else environ
        config = CanaryConfig.from_env(environ)
        if config.injecting:
            raise ValueError("kv-canary: KV_CANARY_INJECT must be unset on vLLM, got "
                             f"{environ.get('KV_CANARY_INJECT')!r} (fault injection is not wired into the vLLM integration: "
                             "planted bugs in vLLM's own code test it, docs/vllm.md)")
        if config.write_check_layers != "fingerprinted":
            raise ValueError("kv-canary: KV_CANARY_WRITE_CHECK_LAYERS must be 'fingerprinted' on vLLM, got "
                             f"{config.write_check_layers!r} (the vLLM integration checks the writes of the heads the "
                             "real-KV hash covers: docs/vllm.md)")
        report_dir = environ.get(REPORT_DIR_VARIABLE) or None
        if report_dir is not None:
            try:
                os.makedirs(report_dir, exist_ok=True)
            except OSError as e:
                raise ValueError(f"kv-canary: {REPORT_DIR_VARIABLE} must be a directory this process can create "
                                 f"and write, got {report_dir!r} ({e})") from None
            if not os.access(report_dir, os.W_OK):
                raise ValueError(f"kv-canary: {REPORT_DIR_VARIABLE} must be a writable directory, got {report_dir!r}")
        interval = _count(environ, TP_INTERVAL_VARIABLE, DEFAULT_TP_INTERVAL)
        return cls(config, report_dir, interval, _count(environ, ALLOCATOR_INTERVAL_VARIABLE, 0))


def _count(environ, name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"kv-canary: {name} must be an integer >= 0, got {raw!r}")
    return value
