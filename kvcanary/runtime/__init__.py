"""The runtime that drives the canary ops forward by forward (SPEC section 5)."""

from kvcanary.runtime.abort import KvCanaryAbortError
from kvcanary.runtime.batch import (ForwardBatch, ForwardMode, PoolSpec, SharedRowError, SwaSpec, TokenAppend,
                                    TokenHistory)
from kvcanary.runtime.canary import Canary
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.report import KvCanaryHealthError, KvCanaryViolationError, Violation, violations_to_json

__all__ = [
    "Canary",
    "CanaryConfig",
    "ForwardBatch",
    "ForwardMode",
    "KvCanaryAbortError",
    "KvCanaryHealthError",
    "KvCanaryViolationError",
    "PoolSpec",
    "SharedRowError",
    "SwaSpec",
    "TokenAppend",
    "TokenHistory",
    "Violation",
    "violations_to_json",
]
