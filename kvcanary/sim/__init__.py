"""A simulated SGLang-style paged-KV engine driving the canary, and the planted-bug zoo.

``run_sim(SimConfig(...))`` plays a seeded workload through the engine and returns
what the canary reported; ``SimConfig(bug=name)`` plants one bug of ``BUGS``.
docs/zoo.md describes the engine, every bug and the measured zoo table. ``hf_bugs`` holds the engine
bugs planted into transformers continuous batching (the demo's and the adapter's tests).
"""

import importlib

# Loaded on first use: the CLI reads ``hf_bugs.BUGS`` through this package without importing torch.
_NAMES = {"BUGS": "bugs", "Bug": "bugs", "BugSwitch": "bugs", "MATRIX": "config", "SimConfig": "config",
          "matrix": "config", "SimEngine": "engine", "SimResult": "engine", "default_canary_config": "engine",
          "run_sim": "engine"}
__all__ = ["BUGS", "MATRIX", "Bug", "BugSwitch", "SimConfig", "SimEngine", "SimResult", "default_canary_config",
           "matrix", "run_sim"]


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"kvcanary.sim.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'kvcanary.sim' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_NAMES))
