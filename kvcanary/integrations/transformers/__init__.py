"""kv-canary on Hugging Face transformers continuous batching: ``attach(model)`` (``handle.py``).

The package's modules, each one part of the canary around one engine forward:

- ``handle``: ``attach``, its handle and ``detach``; the private step-path toggles (``tuned``);
- ``session``: one canary per batch processor and the hooks that feed it;
- ``batch``, ``tokens``, ``staging``: the engine source: the canary's ``ForwardBatch`` from the batch the
  engine prepared, each request's row and token history, the host half's staging;
- ``graphs``, ``fused``, ``glue``, ``glue_cpu``: the step's device work captured, fused, and its index kernels;
- ``layout``, ``layouts``, ``cache_blocks``, ``cache_sectors``: the paged cache's layout, one class per
  cache generation (5.17; 5.18 and later);
- ``moves``: KV moves between steps (fork copies, offload and restore, sweeps);
- ``bugs``: planted engine bugs for the demo and tests; ``varlen_attention``: a per-request paged attention
  for benchmarks.
"""

import importlib

# Loaded on first use: the CLI reads ``bugs.BUGS`` through this package without importing torch.
_HANDLE_NAMES = ("SUPPORTED_RANGE", "TUNING_OPTIONS", "TransformersHandle", "attach", "attach_with", "check_version",
                 "live_handle", "tuned")
__all__ = ["SUPPORTED_RANGE", "TransformersHandle", "attach", "check_version"]


def __getattr__(name: str):
    if name in _HANDLE_NAMES:
        return getattr(importlib.import_module("kvcanary.integrations.transformers.handle"), name)
    raise AttributeError(f"module 'kvcanary.integrations.transformers' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_HANDLE_NAMES))
