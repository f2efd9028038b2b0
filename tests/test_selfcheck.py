"""The self-check runs every op on every usable backend and finds its planted bug."""

from kvcanary.selfcheck import format_selfcheck, run_selfcheck, usable_backends

from conftest import DEVICE


def test_selfcheck_passes_and_reports_every_backend():
    result = run_selfcheck(DEVICE)
    assert result["ok"], format_selfcheck(result)
    backends = {r["backend"] for r in result["rows"]}
    assert backends == set(usable_backends(DEVICE))
    assert result["planted_found"][0]["reason"] == 1 | 32  # chain + token
    assert "self-check passed" in format_selfcheck(result)
