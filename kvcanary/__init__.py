"""kv-canary: a KV-cache integrity sanitizer for paged-KV LLM inference engines.

Nothing happens at import time: build a ``Canary`` for an engine's KV pool and call
``before_forward`` / ``after_forward`` around each forward, or use an integration
(``kvcanary.integrations.transformers.attach``). The names below load on first use,
so ``import kvcanary`` (and ``kvcanary --help``) does not import torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "RealKvSource": "kvcanary.ops",
    **{name: "kvcanary.runtime" for name in (
        "Canary", "CanaryConfig", "ForwardBatch", "ForwardMode", "KvCanaryAbortError", "KvCanaryHealthError", "KvCanaryViolationError",
        "PoolSpec", "SharedRowError", "SwaSpec", "TokenAppend", "TokenHistory", "Violation", "violations_to_json")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvcanary' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
