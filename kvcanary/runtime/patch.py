"""Per-instance rebinding of an engine's methods with an exact undo: how an adapter hooks an engine it does not
own (``integrations/transformers`` sets its hooks through it and restores them on detach)."""

from __future__ import annotations

__all__ = ["Patcher"]


class Patcher:
    """Per-instance rebinding with an exact undo: restores a pre-existing instance attribute, else deletes ours.

    ``expected``: what the hooked engine must be, named in the error for a name that is not a method (e.g. the
    engine versions the hooks were verified on)."""

    def __init__(self, expected: str = "the engine the hooks were written for"):
        self.expected = expected
        self._undo: list[tuple[object, str, bool, object]] = []

    def set(self, obj, name: str, value) -> None:
        if not callable(getattr(obj, name, None)):
            raise RuntimeError(f"kv-canary: {type(obj).__name__}.{name} must be a method to hook, got "
                               f"{type(getattr(obj, name, None)).__name__} ({self.expected} expected)")
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def patched(self, obj, name: str) -> bool:
        return any(o is obj and n == name for o, n, _, _ in self._undo)

    def restore(self) -> None:
        for obj, name, had, old in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                vars(obj).pop(name, None)
        self._undo.clear()
