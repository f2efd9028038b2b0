"""The layout of a paged cache: the ``EngineLayout`` subclass of its generation, by the fields it has.

Apart from ``layout.py`` so that the base class and its subclasses import one way (each subclass
imports the base; only this module imports the subclasses).
"""

from __future__ import annotations

import sys

from kvcanary.integrations.transformers.cache_blocks import BlockLayout
from kvcanary.integrations.transformers.cache_sectors import SectorLayout
from kvcanary.integrations.transformers.layout import SUPPORTED_RANGE, EngineLayout


def layout_of(cache) -> EngineLayout:
    """The layout of ``cache``, by which generation's fields it has (a RuntimeError names what is missing)."""
    gen = SectorLayout if hasattr(cache, "cache_tensor") or hasattr(cache, "cache_allocators") else BlockLayout
    # (another transformers may have moved a field: say what is missing, not an AttributeError in the loop)
    missing = [name for name in gen.FIELDS if not hasattr(cache, name)]
    if missing:
        version = getattr(sys.modules.get("transformers"), "__version__", "unknown")
        raise RuntimeError(f"kv-canary: transformers {version}'s {type(cache).__name__} lacks {missing}, which "
                           f"the integration reads (supported: transformers {SUPPORTED_RANGE})")
    return gen.build(cache)
