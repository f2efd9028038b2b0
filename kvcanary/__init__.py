"""kv-canary: a KV-cache integrity sanitizer for paged-KV LLM inference engines.

Nothing happens at import time; see ``kvcanary.Canary`` (runtime) and ``kvcanary.ops``.
"""

__version__ = "0.1.0"
