"""kv-canary: a KV-cache integrity sanitizer for paged-KV LLM inference engines.

Nothing happens at import time: build a ``Canary`` for an engine's KV pool and call
``before_forward`` / ``after_forward`` around each forward, or use an integration
(``kvcanary.integrations.transformers.attach``).
"""

from kvcanary.ops import RealKvSource
from kvcanary.runtime import (
    Canary,
    CanaryConfig,
    ForwardBatch,
    ForwardMode,
    KvCanaryHealthError,
    KvCanaryViolationError,
    PoolSpec,
    SwaSpec,
    TokenHistory,
    Violation,
    violations_to_json,
)

__version__ = "0.1.0"

__all__ = [
    "Canary",
    "CanaryConfig",
    "ForwardBatch",
    "ForwardMode",
    "KvCanaryHealthError",
    "KvCanaryViolationError",
    "PoolSpec",
    "RealKvSource",
    "SwaSpec",
    "TokenHistory",
    "Violation",
    "violations_to_json",
]
