"""The hand-driven example in docs/runtime.md runs as written and catches its planted stale entry."""

import pathlib
import re

import pytest

from kvcanary import KvCanaryViolationError

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "runtime.md"


def test_runtime_doc_example_raises_on_the_stale_entry():
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    scope: dict = {}
    with pytest.raises(KvCanaryViolationError) as info:
        exec(compile(code, str(DOC), "exec"), scope)
    assert scope["canary"].step == 3
    assert {v.slot for v in info.value.violations} == {7}
    assert len(code.strip().splitlines()) <= 25
