"""kv-canary on Hugging Face transformers continuous batching: ``attach(model)`` (``handle.py``).

The package's modules, each one part of the canary around one engine forward (the forward itself: the
runtime's step runner, ``kvcanary.runtime.step``, which ``batch.BatchBuilder`` feeds as its engine source):

- ``handle``: ``attach``, its handle and ``detach``; the private step-path toggles (``tuned``);
- ``session``: one canary and step runner per batch processor, and the hooks that feed them;
- ``batch``: the engine source: each step's host part from the batch the engine prepared, its inputs, each
  request's row and token history;
- ``layout``, ``layouts``, ``cache_blocks``, ``cache_sectors``: the paged cache's layout, one class per
  cache generation (5.17; 5.18 and later);
- ``moves``: KV moves between steps (fork copies, offload and restore, sweeps);
- ``events``: the engine's request and block events (mode abort, the allocator check, poison on free);
- ``reach``: the tools' side of each cache generation, beside its layout: the internals a planted bug reaches
  (one class per generation), and the transformers set-up the demo, benchmarks, soak runs and tests share.

The engine bugs planted for the demo and tests live in ``kvcanary.sim.hf_bugs`` (they reach the engine through
``reach``), the benchmarks' varlen attention in ``kvcanary.bench.varlen_attention``.
"""

import importlib

# Loaded on first use: importing the package imports no torch.
_HANDLE_NAMES = ("SUPPORTED_RANGE", "TUNING_OPTIONS", "TransformersHandle", "attach", "check_version", "live_handle",
                 "tuned")
__all__ = ["SUPPORTED_RANGE", "TransformersHandle", "attach", "check_version"]


def __getattr__(name: str):
    if name in _HANDLE_NAMES:
        return getattr(importlib.import_module("kvcanary.integrations.transformers.handle"), name)
    raise AttributeError(f"module 'kvcanary.integrations.transformers' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_HANDLE_NAMES))
