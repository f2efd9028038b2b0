"""The Triton interpreter's language patching, done once per launch in the tests (a test helper, not a test).

Under ``TRITON_INTERPRET=1`` the interpreter swaps ``triton.language``'s builtins for interpreted ones when a
launch starts (``_patch_lang``) and swaps them back when it ends. It also calls ``_patch_lang`` at every call of a
``@triton.jit`` device function inside the kernel (the canary's ``splitmix64``, ``record_ptr``, ...; ``tl.zeros``),
where the modules are already patched: each such call walks the whole module (``inspect.getmembers``) to find
nothing left to patch, and throws the result away (that scope is never restored). Measured on the 2-core dev CPU,
those repeats were about a third of an interpreted launch's time; the suite's route tests launch thousands.

``install`` keeps the first patch of each language module within a launch and skips the repeats of the same
modules: a device function whose modules the launch has already patched gets an empty scope. Which builtins are
patched, and when they are restored, is unchanged: the first call of a launch patches as before, a device
function reaching a module the launch has not patched yet (``triton.language.core`` from ``tl.zeros``) patches it
as before, and the launch's end restores what it restored before. What the kernels compute is not touched: the op
tests compare every interpreted kernel with the reference and torch bodies bit for bit (tests/test_ops_cases.py).
Where the interpreter lacks these names (another Triton), nothing is changed.
"""

from __future__ import annotations

import inspect
import os
import sys


def install() -> bool:
    """Skip the interpreter's repeated patching inside a launch; True where installed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    launch = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if patch is None or scope_type is None or launch is None or getattr(patch, "_once_per_launch", False):
        return False
    launch_code = launch.__code__
    patched: list[frozenset] = []  # the language modules the running launch has patched (empty: no launch runs)

    def langs_of(fn) -> frozenset:
        # (the interpreter's own choice: the modules tl and tl.core among the function's globals)
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))

    def once_per_launch(fn):
        langs = langs_of(fn)
        if sys._getframe(1).f_code is launch_code:  # a launch starts: its scope is restored when it ends
            patched.clear()
            scope = patch(fn)
            patched.append(langs)
            restore = scope.restore

            def restore_and_end():
                try:
                    restore()
                finally:
                    patched.clear()

            scope.restore = restore_and_end
            return scope
        if patched and langs <= patched[-1]:  # patched by this launch: the repeat would find nothing to patch
            return scope_type()
        scope = patch(fn)  # (a module the launch has not patched yet, or no launch runs: patched as before)
        if patched:
            patched[-1] = patched[-1] | langs
        return scope

    once_per_launch._once_per_launch = True
    interpreter._patch_lang = once_per_launch
    return True
