"""Diagnosis of a false alarm under async batching with a lagging side stream (H200, transformers >= 5.24).

``tests/test_hf_async.py::test_a_clean_async_run_stays_clean_when_the_side_stream_lags`` delays every captured
step's canary work by a few milliseconds on the device. At 7b6a78a (5.24.0, H200) it reported 586
``reserved_slot_write`` rows on a clean run, the first at step 1: a write of token 0 at position 0 into slot 16,
the pattern of a padding lane (the engine's write trash) counted as a live token. This runs the same clean
workload once per step path, with and without the lag, and prints for each: the violations by (launch, reason,
slot, position, token), the steps they name, and whether the tokens equal a canary-less async run. The path
whose toggle makes the rows go away holds the unordered read.

    bash benchmarks/gpu_wheels.sh install /tmp/t524 && PYTHONPATH=/tmp/t524:$PWD python3 benchmarks/async_lag_probe.py
"""

from __future__ import annotations

import collections
import sys

import torch

VARIANTS = {  # name -> attach options (step-path toggles and config fields, kvcanary.integrations.transformers.reach.attach_with)
    "default": {},
    "fused_steps=0": {"fused_steps": False},
    # (the fused graphs' own wait nodes: the one ordering the CPU's recorded model of the adapter leaves out,
    # tests/hf_async_model.py)
    "in_graph_waits=0": {"in_graph_waits": False},
    "bucket_batches=0 (no padding requests)": {"bucket_batches": False},
    "step_graphs=0 (eager steps)": {"step_graphs": False},
    "reserved_check=0": {"reserved_check": False},
}
LAG_NS = 5_000_000  # the test's delay before each captured step's work


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("kv-canary: async_lag_probe.py needs a CUDA GPU (transformers refuses async batching on the "
                         "CPU)")
    from kvcanary.demo import build_tiny_model, run_workload
    from kvcanary.runtime.step.graphs import StepGraphs

    cb = {"use_cuda_graph": True, "use_async_batching": True}
    model = build_tiny_model("cuda")
    orig = StepGraphs._run

    def lagging(self, e, sightings, h):
        torch.cuda._sleep(LAG_NS)
        return orig(self, e, sightings, h)

    kw = dict(cb=cb, device="cuda", num_return_sequences=1, max_new_tokens=16)
    base = run_workload(model, canary=False, **kw)
    for lag in (True, False):
        StepGraphs._run = lagging if lag else orig
        for name, options in VARIANTS.items():
            try:
                run = run_workload(model, **kw, **options)
            except Exception as exc:  # noqa: BLE001 (a variant that fails says so and the others still run)
                print(f"lag={lag} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            v = run.violations
            kinds = collections.Counter((x.launch_tag, x.reasons, x.slot, x.position, x.stored_token) for x in v)
            steps = sorted(collections.Counter(x.step for x in v).items())
            print(f"lag={lag} {name}: {len(v)} violations, tokens equal {run.tokens == base.tokens}, forwards "
                  f"{run.stats.get('forwards')}; top {kinds.most_common(4)}; steps {steps[:16]}", flush=True)
            for line in run.log_lines[:2]:
                print("    " + line[:400], flush=True)
    StepGraphs._run = orig
    return 0


if __name__ == "__main__":
    sys.exit(main())
