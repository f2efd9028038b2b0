"""The self-check runs every op on every usable backend, finds its planted bug and names what it skipped."""

import torch

from kvcanary.selfcheck import OPS, format_selfcheck, run_selfcheck, skipped_backends, usable_backends

from conftest import DEVICE


def test_selfcheck_passes_and_reports_every_op_on_every_backend():
    result = run_selfcheck(DEVICE)
    assert result["ok"], format_selfcheck(result)
    backends = usable_backends(DEVICE)
    assert sorted((r["op"], r["backend"]) for r in result["rows"]) == sorted((o, b) for o in OPS for b in backends)
    assert {"read_table", "accept_rewrites", "attention"} <= set(OPS)
    assert result["planted_found"][0]["reason"] == 1 | 32  # chain + token
    assert result["rewrites_accepted"] == 1  # the same record's rewrite, not the changed one
    assert "self-check passed" in format_selfcheck(result)


def test_selfcheck_names_each_skipped_backend_and_why(monkeypatch):
    from kvcanary.ops import api

    monkeypatch.setattr(api, "numba_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    skipped = skipped_backends(cpu)
    assert set(skipped) == {"numba", "triton"} and "kv-canary[cpu]" in skipped["numba"]
    assert usable_backends(cpu) == ["reference", "torch"]
    text = format_selfcheck(run_selfcheck(cpu))
    assert f"skipped numba: {skipped['numba']}" in text and f"skipped triton: {skipped['triton']}" in text
    assert "numba" in skipped_backends(torch.device("cuda"))  # (CPU tensors only)
