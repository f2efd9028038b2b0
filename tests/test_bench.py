"""The op benchmark checks correctness before timing and reports every (provider, op, mode)."""

import io

import torch

from kvcanary.bench import ops as bench
from kvcanary.ops import api

from conftest import DEVICE, FAST_BACKENDS

# numba is optional (the [cpu] extra): the benchmark compares the backends that import.
PROVIDERS = [b for b in FAST_BACKENDS if b != "numba" or api.numba_available()]


def test_bench_runs_a_tiny_workload_and_agrees_across_providers():
    out = bench.run(DEVICE, PROVIDERS, {"tiny": (3, 17, 5)}, progress=io.StringIO())
    rows = out["results"]
    assert {(r["provider"], r["op"], r["real_kv"]) for r in rows} == {
        (p, op, mode) for p in PROVIDERS for op in ("verify", "write") + (("write_hinted",) if p == "triton" else ())
        for mode in ("none", "partial")}
    assert all(r["entries"] == (3 * 17 if r["op"] == "verify" else 3 * 5) and r["ms"] > 0 for r in rows)
    assert all(r["ms_p20"] <= r["ms"] <= r["ms_p80"] for r in rows)
    assert out["meta"]["device"] == str(DEVICE) and out["meta"]["copy_gb_per_s"] > 0


def test_bench_setup_chain_is_clean_and_a_planted_flip_is_seen():
    s = bench.Setup(2, 9, 3, torch.device("cpu"))
    s.verify("reference")
    assert int(s.ring.write_index[0]) == 0
    s.kv.view(torch.uint8)[int(s.rtt[1, 4]), 0] ^= 1
    s.verify("reference")
    assert int(s.ring.write_index[0]) == 1 and int(s.ring.rows[0, 1]) == int(s.rtt[1, 4])


def test_bench_rejects_an_unknown_workload(capsys):
    from kvcanary import cli

    assert cli.main(["bench", "--device", "cpu", "--workloads", "no-such-workload"]) == 2
    assert "bench workloads must be among" in capsys.readouterr().err
