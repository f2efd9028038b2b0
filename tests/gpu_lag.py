"""A GPU stream made to lag, for the async tests' race checks (a module of its own, not conftest: tests/vllm has a
conftest of its own, and a test importing ``conftest`` at run time may get that one when both directories run in
one session)."""

from __future__ import annotations

import torch


def lag_before(monkeypatch, owner, name: str, stream_of=None, cycles: int = 5_000_000) -> None:
    """Make a GPU stream lag (a sleep kernel of ``cycles`` clock cycles, a few milliseconds on the H200) before
    each call of ``owner.name``: on the current stream, or on ``stream_of(self)`` where given. The async tests
    use it as a busy GPU makes a stream lag, so a missing ordering shows as a race."""
    orig = getattr(owner, name)

    def lagging(self, *args, **kwargs):
        with torch.cuda.stream(None if stream_of is None else stream_of(self)):  # (None: the current stream)
            torch.cuda._sleep(cycles)
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, lagging)
