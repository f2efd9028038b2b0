"""pytest plugin: a test that drives a paged-KV engine fails on any KV-cache violation.

Installed with the package (the ``pytest11`` entry point ``kvcanary``); nothing runs unless a test
asks for the ``kv_canary`` fixture. The fixture builds or watches canaries in mode "raise" and,
once the test body returns, drains every one of them: a violation fails the test with the readable
report, also when the engine swallowed the ``KvCanaryViolationError`` or reported it late.

    def test_my_engine(kv_canary):
        engine = MyEngine(canary_factory=kv_canary)          # kv_canary(pool, **Canary args) -> Canary
        engine.generate(prompts)

    def test_transformers_cb(kv_canary, model):
        kv_canary.attach(model)                              # kvcanary.integrations.transformers.attach
        model.generate_batch(prompts, generation_config=gen)

docs/runtime.md ("Testing an engine with pytest") has the full description.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

REPORTED = 5  # readable violation blocks in a failure message (the count covers them all)


class KvCanaryGuard:
    """What the ``kv_canary`` fixture gives a test: canaries in mode "raise" whose violations fail it."""

    def __init__(self):
        self.canaries: list = []
        self.handles: list = []

    def __call__(self, pool, config=None, **canary_args):
        """A ``Canary(pool, config, **canary_args)`` in mode "raise", watched (config default: the environment's)."""
        from kvcanary.runtime import Canary, CanaryConfig

        config = (CanaryConfig.from_env() if config is None else config).replace(mode="raise")
        return self.watch(Canary(pool, config, **canary_args))

    def watch(self, canary):
        """Watch a canary the engine built itself (any mode); returns it."""
        from kvcanary.runtime import Canary

        if not isinstance(canary, Canary):
            raise TypeError(f"kv-canary: kv_canary.watch canary must be a Canary, got {type(canary).__name__}")
        self.canaries.append(canary)
        return canary

    @contextmanager
    def watching(self, canary) -> Iterator:
        """``with kv_canary.watching(canary):`` checks the canary when the block ends, not only at the test's end."""
        self.watch(canary)
        yield canary
        self.check()

    def attach(self, model_or_manager, **options):
        """``kvcanary.integrations.transformers.attach`` in mode "raise"; detached when the test ends."""
        from kvcanary.integrations.transformers import attach

        handle = attach(model_or_manager, **{**options, "mode": "raise"})
        self.handles.append(handle)
        return handle

    def violations(self) -> list:
        """Every violation of every watched canary and attached handle (drained first)."""
        out = []
        for c in self.canaries:
            out.extend(c.flush())
        for h in self.handles:
            out.extend(h.flush())
        return out

    def report(self) -> str | None:
        """The failure message, or None when every canary is clean."""
        violations = self.violations()
        errors = [e for h in self.handles for e in h.errors if type(e).__name__ != "KvCanaryViolationError"]
        if not violations and not errors:
            return None
        lines = [f"kv-canary: {len(violations)} KV-cache violation(s) during the test"]
        describe = self.handles[-1].describe if self.handles and not self.canaries else (lambda v: v.block())
        lines += [describe(v) for v in violations[:REPORTED]]
        if len(violations) > REPORTED:
            lines.append(f"... and {len(violations) - REPORTED} more:")
            lines += [v.log_line() for v in violations[REPORTED:REPORTED + 50]]
        lines += [f"kv-canary: the engine hook raised {type(e).__name__}: {e}" for e in errors]
        return "\n".join(lines)

    def check(self) -> None:
        """Fail the running test if any watched canary saw a violation."""
        text = self.report()
        if text is not None:
            pytest.fail(text, pytrace=False)

    def close(self) -> None:
        for h in self.handles:
            if h._attached:
                h.detach()


@pytest.fixture
def kv_canary() -> Iterator[KvCanaryGuard]:
    """Canaries in mode "raise" for this test; any violation fails it with the report (see module doc)."""
    guard = KvCanaryGuard()
    try:
        yield guard
    finally:
        guard.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    guard = getattr(item, "funcargs", {}).get("kv_canary")
    if not isinstance(guard, KvCanaryGuard):
        return (yield)
    try:
        result = yield
    except Exception as e:
        # A violation raised inside the test (after_forward in mode "raise"): fail with the whole report.
        if type(e).__name__ == "KvCanaryViolationError" or any(e in h.errors for h in guard.handles):
            text = guard.report()
            if text is not None:
                pytest.fail(text, pytrace=False)
        raise
    guard.check()
    return result
