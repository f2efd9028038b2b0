"""Whether numba's on-disk cache holds the compiled kernels, and the one-line notice when it does not.

numba compiles each kernel at its first call and, with ``cache=True``, keeps it on disk (next to the source or
in the user's cache directory) for later processes. A fresh install, or an edited kernel file, compiles them
all once: tens of seconds on a small CPU, which without a word looks like a hang (the first demo's run with
the canary took 44 s against 3 s without). The kernel modules call ``announce`` when they are imported, just
before their first compile, so the process says once why it waits.
"""

from __future__ import annotations

import sys

NOTICE = "kv-canary: compiling the numba kernels on first use (tens of seconds, once; cached on disk after)"
_announced = False


def cold(namespace: dict) -> bool:
    """Whether no jitted function of ``namespace`` (a module's globals) has a usable build in numba's disk cache:
    a fresh install, or a kernel file edited since (numba keys its cache on the file), so the first calls compile.
    (One kernel first called later compiles alone, in a moment.) False where the cache cannot be read this way."""
    from numba.core.dispatcher import Dispatcher

    jitted = [f for f in list(namespace.values())
              if isinstance(f, Dispatcher) and f.py_func.__module__ == namespace["__name__"]]
    try:
        # (numba's index of a function's cached builds: {} when missing, of another numba or stale)
        return bool(jitted) and not any(f._cache._cache_file._load_index() for f in jitted)
    except (AttributeError, OSError, ValueError):
        return False


def will_compile() -> bool:
    """Whether the numba backend's first use in this process compiles kernels (imports the kernel modules)."""
    from kvcanary.ops import numba_kernels, numba_steady

    return cold(vars(numba_kernels)) or cold(vars(numba_steady))


def announce(namespace: dict) -> None:
    """Print ``NOTICE`` to stderr, once per process, when ``namespace``'s kernels are not on disk yet."""
    global _announced
    if not _announced and cold(namespace):
        _announced = True
        print(NOTICE, file=sys.stderr, flush=True)
